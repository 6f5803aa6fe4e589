"""The frontend's own clocks: the cyclic collector's time is read from the collector's start and
stop callbacks, and the tuning moves start-up objects out of its generations."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tandem.frontend.diagnostics import GcClock, read_clock, tune_gc

DELAY_S = 0.05


@pytest.fixture
def gc_clock() -> Iterator[GcClock]:
    clock = GcClock()
    yield clock
    clock.uninstall()


def test_a_collection_is_counted_with_the_time_it_ran(gc_clock: GcClock) -> None:
    """A callback installed after the clock's sleeps inside each collection: the clock sees
    that delay, which it would not if it timed anything but the collection."""

    def slow(phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            time.sleep(DELAY_S)

    gc.callbacks.append(slow)
    try:
        before = read_clock(gc_clock)
        gc.collect()
        gc.collect()
        after = read_clock(gc_clock)
    finally:
        gc.callbacks.remove(slow)
    assert after.gc_collections - before.gc_collections == 2
    assert after.gc_s - before.gc_s >= 2 * DELAY_S
    assert after.gc_s - before.gc_s < 2 * DELAY_S + 5.0  # only the collections, not the test


def test_an_uninstalled_clock_stops_counting(gc_clock: GcClock) -> None:
    gc.collect()
    counted = gc_clock.collections
    gc_clock.uninstall()
    gc.collect()
    assert gc_clock.collections == counted
    assert read_clock().gc_collections == 0  # no clock: nothing to read


def test_tuning_freezes_what_is_alive_and_raises_the_first_threshold() -> None:
    old = gc.get_threshold()
    try:
        alive = [[i] for i in range(1000)]  # tracked containers made before the tuning
        tune_gc(12_345)
        assert gc.get_threshold() == (12_345, old[1], old[2])
        assert gc.get_freeze_count() >= len(alive)
        generations = {id(o) for o in gc.get_objects()}  # the frozen are in none of them
        assert not any(id(x) in generations for x in alive)
    finally:
        gc.unfreeze()
        gc.set_threshold(*old)
    with pytest.raises(ValueError, match="threshold: must be at least 1"):
        tune_gc(0)
