"""Pinning a whole process to some of its node's cores (ranks with ``pin_cores_per_rank``,
frontends with ``frontend_cores``).

A process's threads each have their own affinity, and a thread starts with its creator's: every
thread there is now is pinned, so the ones they start later stay on the same cores. A frontend
kept off the cores of the ranks' step loops matters: a token push over loopback wakes the
frontend, and Linux puts the woken process on the waker's core, where it preempts the step loop
for as long as it handles the push.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable


def node_cores() -> int:
    """How many cores this node has."""
    return os.cpu_count() or 1


def check_cores(cores: Iterable[int], field: str) -> tuple[int, ...]:
    """``cores`` as a sorted tuple; ``ValueError`` naming ``field`` when one is not a core of
    this node."""
    total, cores = node_cores(), list(cores)
    bad = [c for c in cores if not 0 <= c < total]
    if bad:
        raise ValueError(f"{field}: core {bad[0]} is not a core of this node, which has cores 0-{total - 1}")
    return tuple(sorted(set(cores)))


def pin_process(cores: Iterable[int]) -> tuple[int, ...]:
    """Pin every thread of this process to ``cores``; the cores."""
    pinned = tuple(sorted(set(cores)))
    for task in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), pinned)
    return pinned
