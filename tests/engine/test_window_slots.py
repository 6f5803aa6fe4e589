"""A V4 rank's window slots (``engine/window_slots.py``): a slot per page up to the capacity,
the least recently used page's taken back first, a refilled page's slot free again."""

from __future__ import annotations

import pytest

from tandem.engine.window_slots import WindowSlots


def test_slots_go_to_the_least_recently_used_page_first_and_come_back_on_release() -> None:
    slots = WindowSlots(2)
    first, second = slots.take(10), slots.take(11)
    assert {first, second} == {0, 1} and len(slots) == 2
    assert slots.get(10) == first  # 10 is now the more recent
    third = slots.take(12)  # full: 11's slot is taken back
    assert third == second and not slots.has(11) and slots.has(10) and slots.has(12)
    assert slots.take(12) == third  # a page keeps its slot
    slots.release(10)
    assert not slots.has(10) and slots.take(13) == first
    slots.release(99)  # a page without a slot: nothing
    assert len(slots) == 2


def test_no_slots_keep_nothing_and_a_negative_capacity_is_refused() -> None:
    slots = WindowSlots(0)
    assert slots.take(1) is None and not slots.has(1)
    with pytest.raises(ValueError, match="window slots must be 0 or more"):
        WindowSlots(-1)


def test_a_step_keeps_every_kth_page_of_the_request_and_its_last_with_the_window_before_each() -> None:
    slots = WindowSlots(8, every=4)
    pages = tuple(range(100, 120))
    # pages 2..9 of the request completed in one step: the 4th and 8th of the request, the last
    assert slots.to_keep(pages, 2, 10, reach=1) == {103, 107, 109}
    # a window over two pages: each with the page before it (within the step)
    assert slots.to_keep(pages, 2, 10, reach=2) == {102, 103, 106, 107, 108, 109}
    assert slots.to_keep(pages, 5, 5, reach=1) == set()  # a step that completes no page


def test_a_run_is_restorable_up_to_the_last_written_page_that_keeps_a_slot() -> None:
    slots = WindowSlots(4)
    for page in (11, 13):
        slots.take(page)
    run, written = [10, 11, 12, 13, 14], {10, 11, 12, 13, 14}
    assert slots.restorable(run, written, reach=1) == 4  # 14 has no slot: up to 13
    assert slots.restorable(run, written - {12}, reach=1) == 2  # 12 not written: up to 11
    assert slots.restorable(run, written, reach=2) == 0  # no two neighbours both hold slots


def test_a_page_with_a_slot_is_the_better_holder_of_its_tokens_hash() -> None:
    slots = WindowSlots.for_share(2, 0.25)
    assert slots.every == 4
    slots.take(7)
    assert slots.better_holder(3, 7) and not slots.better_holder(7, 3) and not slots.better_holder(3, 4)
