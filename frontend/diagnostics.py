"""What the frontend process spends, read from inside it: its CPU clocks, and a cProfile of its
event loop's thread (where the gRPC server, the pushes from the ranks and every stream run).

Both are read through the actor (``Frontend.clock``, ``start_profile``, ``stop_profile``), so a
benchmark measures the frontend's CPU on the frontend's own clocks, not from outside.
"""

from __future__ import annotations

import cProfile
import pstats
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class ProcessClock:
    """One reading of this process's clocks: ``monotonic_s`` (wall), ``process_cpu_s`` (every
    thread's CPU) and ``thread_cpu_s`` (the CPU of the thread that read it: on the actor, the
    event loop's)."""

    monotonic_s: float
    process_cpu_s: float
    thread_cpu_s: float


def read_clock() -> ProcessClock:
    return ProcessClock(time.monotonic(), time.process_time(), time.thread_time())


@dataclass(frozen=True)
class ProfileRow:
    """One function's own time (``tottime``: not counting what it called) in a profile."""

    file: str  # "~" for a built-in (C) function
    function: str
    calls: int
    own_s: float


class LoopProfiler:
    """A cProfile of the thread that starts it, on that thread's CPU clock (time spent waiting
    for events is not counted); one profile at a time."""

    def __init__(self) -> None:
        self._profile: cProfile.Profile | None = None

    def start(self) -> None:
        if self._profile is not None:
            raise RuntimeError("a profile is already running; stop it first")
        self._profile = cProfile.Profile(time.thread_time)
        self._profile.enable()

    def stop(self) -> list[ProfileRow]:
        """Every profiled function's own time, largest first; empty when none was running."""
        profile, self._profile = self._profile, None
        if profile is None:
            return []
        profile.disable()
        stats = pstats.Stats(profile).stats  # type: ignore[attr-defined]
        rows = [
            ProfileRow(file, function, int(calls), float(own_s))
            for (file, _line, function), (_primitive, calls, own_s, _cumulative, _callers) in stats.items()
        ]
        return sorted(rows, key=lambda r: r.own_s, reverse=True)
