from __future__ import annotations

import pytest

from tandem.router.load import DecodeStats, LoadIntegrityError, LoadTracker


def tracker() -> LoadTracker:
    load = LoadTracker()
    load.set_ranks(["p-r0", "p-r1"], ["d-r0", "d-r1"])
    return load


def test_prefill_tokens_leave_once_whichever_signal_comes_first() -> None:
    load = tracker()
    load.add("a", "p-r0", 100, "d-r0", 3)
    load.add("b", "p-r0", 50, "d-r1", 2)
    load.add("c", "p-r1", 7, "d-r0", 1)
    assert load.prefill_loads() == {"p-r0": 150, "p-r1": 7}
    assert load.decode_loads() == {"d-r0": 2, "d-r1": 1}
    load.prefill_done("a")
    load.prefill_done("a")
    assert load.prefill_tokens("p-r0") == 50
    load.finish("a")
    load.finish("a")
    load.finish("b")  # finished (or aborted) before prefill_done: both parts go at once
    load.prefill_done("b")
    load.prefill_done("never-routed")
    assert load.prefill_loads() == {"p-r0": 0, "p-r1": 7}
    assert load.decode_loads() == {"d-r0": 1, "d-r1": 0}
    assert load.routed_tokens("p-r0") == 150 and load.num_in_flight == 1
    load.check_integrity()


def test_promised_pages_last_until_a_report_after_the_prefill() -> None:
    load = tracker()
    load.add("a", "p-r0", 10, "d-r0", 4)
    load.add("b", "p-r0", 10, "d-r0", 6)
    load.update_decode_stats("d-r0", 90, 0, 100)  # may predate the reservation: promises stay
    assert load.promised_pages("d-r0") == 10
    load.prefill_done("a")
    assert load.promised_pages("d-r0") == 10
    load.update_decode_stats("d-r0", 80, 1, 100)
    assert load.promised_pages("d-r0") == 6
    assert load.decode_stats("d-r0") == DecodeStats(80, 1, 100)
    load.finish("b")
    assert load.promised_pages("d-r0") == 0 and load.decode_stats("d-r1") is None
    load.check_integrity()


def test_ranks_that_leave_stop_counting() -> None:
    load = tracker()
    load.add("a", "p-r0", 10, "d-r0", 4)
    load.add("b", "p-r1", 20, "d-r1", 5)
    load.update_decode_stats("d-r1", 10, 1, 20)
    load.set_ranks(["p-r1", "p-r2"], ["d-r0"])
    assert load.prefill_loads() == {"p-r1": 20, "p-r2": 0}
    assert load.decode_loads() == {"d-r0": 1}
    assert "a" in load and "b" in load  # each still has one tracked rank
    load.update_decode_stats("d-r1", 10, 1, 20)  # a late report of the rank that left
    assert load.decode_stats("d-r1") is None
    load.set_ranks(["p-r2"], ["d-r0"])
    assert "b" not in load and "a" in load
    load.finish("a")
    load.finish("b")
    assert load.num_in_flight == 0
    load.check_integrity()


def test_bad_inputs_are_rejected() -> None:
    load = tracker()
    load.add("a", "p-r0", 1, "d-r0", 1)
    with pytest.raises(ValueError, match="already in flight"):
        load.add("a", "p-r1", 1, "d-r0", 1)
    with pytest.raises(ValueError, match="negative"):
        load.add("b", "p-r1", -1, "d-r0", 1)
    with pytest.raises(ValueError, match="bad stats"):
        load.update_decode_stats("d-r0", 11, 0, 10)
    load.check_integrity()


def test_check_integrity_notices_a_total_that_drifted() -> None:
    load = tracker()
    load.add("a", "p-r0", 10, "d-r0", 1)
    load._prefill_tokens["p-r0"] -= 11
    with pytest.raises(LoadIntegrityError, match="prefill tokens"):
        load.check_integrity()
