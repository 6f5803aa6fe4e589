"""What the frontend process spends, read from inside it: its CPU clocks, the time its cyclic
garbage collector ran, and a cProfile of its event loop's thread (where the gRPC server, the
pushes from the ranks and every stream run).

Both are read through the actor (``Frontend.clock``, ``start_profile``, ``stop_profile``), so a
benchmark measures the frontend's CPU on the frontend's own clocks, not from outside.
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import time
from dataclasses import dataclass
from typing import Any

# Python's default first threshold (700) counts allocations net of frees of objects the cyclic
# collector tracks; a frontend at full load crosses it a few hundred times a second, and a
# collection walks every young object: 3 - 4% of the frontend's CPU at 256 streams (``tandem
# bench host --parts frontend``: ``frontend_gc_share``). Its streams make no reference cycles in
# steady state, so a collection is only due once 50,000 more objects are alive than at the last
# one; the older generations keep Python's ratios.
GC_THRESHOLD = 50_000


def tune_gc(threshold: int = GC_THRESHOLD) -> None:
    """Collect now, freeze what is alive (the process's code and startup objects: later
    collections skip them) and raise the first generation's threshold to ``threshold``."""
    if threshold < 1:
        raise ValueError(f"threshold: must be at least 1, got {threshold}")
    gc.collect()
    gc.freeze()
    _, second, third = gc.get_threshold()
    gc.set_threshold(threshold, second, third)


class GcClock:
    """Seconds the cyclic garbage collector ran in this process and its collections, from the
    collector's own start and stop callbacks (each collection is the difference of two readings
    of ``time.perf_counter``; collections never overlap: the collector runs under the GIL and
    refuses to start while one runs). Installed once; :meth:`uninstall` removes it."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._started: float | None = None  # when the running collection started
        gc.callbacks.append(self._callback)

    def _callback(self, phase: str, _info: dict[str, Any]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
        elif self._started is not None:
            self.seconds += now - self._started
            self.collections += 1
            self._started = None

    def uninstall(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)


@dataclass(frozen=True)
class ProcessClock:
    """One reading of this process's clocks: ``monotonic_s`` (wall), ``process_cpu_s`` (every
    thread's CPU), ``thread_cpu_s`` (the CPU of the thread that read it: on the actor, the
    event loop's), and the cyclic collector's seconds and collections so far (0 without a
    :class:`GcClock`)."""

    monotonic_s: float
    process_cpu_s: float
    thread_cpu_s: float
    gc_s: float = 0.0
    gc_collections: int = 0


def read_clock(gc_clock: GcClock | None = None) -> ProcessClock:
    seconds, collections = (gc_clock.seconds, gc_clock.collections) if gc_clock else (0.0, 0)
    return ProcessClock(time.monotonic(), time.process_time(), time.thread_time(), seconds, collections)


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
