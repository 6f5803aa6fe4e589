"""A running request whose grammar still compiles sits decode steps out (``held``) without a
place in the batch, keeps its pages, and joins once it is no longer held; ``fail`` ends one
whose grammar did not compile, its pages freed. Hand-made requests on the real scheduler,
checked with ``check_integrity`` after each call."""

from __future__ import annotations

from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.types import DecodeSchedulerConfig
from tandem.engine.request import Request, RequestStatus
from tandem.wire.request_params import FinishReason, SamplingParams

PAGE = 4


def _running(scheduler: DecodeScheduler, *ids: str) -> None:
    """Requests of 6 prompt tokens, their KV arrived (first token 7)."""
    for request_id in ids:
        scheduler.add_request(Request(request_id, [1, 2, 3, 4, 5, 6], SamplingParams(max_tokens=8)))
    for reservation in scheduler.reserve(now=0.0):
        scheduler.kv_arrived(reservation.request_id, 7, 0, attempt=reservation.attempt)
    assert all(scheduler.status(r) is RequestStatus.RUNNING for r in ids)
    scheduler.check_integrity()


def _step(scheduler: DecodeScheduler, held: frozenset[str] = frozenset()) -> list[str]:
    plan = scheduler.schedule(held=held)
    scheduler.update(plan, {c.request_id: 9 for c in plan.chunks})
    scheduler.check_integrity()
    return [c.request_id for c in plan.chunks]


def test_a_held_request_sits_steps_out_and_joins_once_released() -> None:
    scheduler = DecodeScheduler(DecodeSchedulerConfig(num_pages=32, page_size=PAGE, max_model_len=64))
    _running(scheduler, "guided", "a", "b")
    pages = list(scheduler.get("guided").page_ids)  # type: ignore[union-attr]
    for _ in range(3):
        assert _step(scheduler, frozenset({"guided"})) == ["a", "b"]
    guided = scheduler.get("guided")
    assert guided is not None and guided.output_token_ids == [7] and guided.page_ids == pages
    assert _step(scheduler) == ["guided", "a", "b"]
    assert guided.output_token_ids == [7, 9]


def test_a_held_request_takes_no_place_in_the_batch() -> None:
    config = DecodeSchedulerConfig(num_pages=32, page_size=PAGE, max_model_len=64, max_num_seqs=2)
    scheduler = DecodeScheduler(config)
    _running(scheduler, "guided", "a", "b")
    assert _step(scheduler, frozenset({"guided"})) == ["a", "b"]  # not just "a"


def test_fail_ends_a_running_request_with_its_error_and_frees_its_pages() -> None:
    scheduler = DecodeScheduler(DecodeSchedulerConfig(num_pages=32, page_size=PAGE, max_model_len=64))
    _running(scheduler, "guided", "a")
    free = scheduler.num_free_pages
    finished = scheduler.fail("guided", "guide: did not compile within the limit of 30 s")
    assert finished is not None and finished.finish_reason is FinishReason.ERROR
    assert finished.error is not None and "within the limit" in finished.error
    assert scheduler.num_free_pages == free + 2 and scheduler.get("guided") is None
    scheduler.check_integrity()
    assert scheduler.fail("guided", "again") is None  # gone: nothing changes
    assert _step(scheduler) == ["a"]
