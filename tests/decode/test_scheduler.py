from __future__ import annotations

import dataclasses
import hashlib
import random
import subprocess
import sys
from typing import Any

import pytest

from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.types import (
    AbortAction,
    DecodeFinished,
    DecodeSchedulerConfig,
    KVNotificationError,
    Reservation,
)
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler_output import SchedulerOutput, StaleSchedulerOutputError
from tandem.kvtransfer.types import KVDestination
from tandem.wire.request_params import InvalidRequestError, SamplingParams

PAGE = 4
TIMEOUT_S = 5.0


def token_for(request_id: str, output_index: int) -> int:
    """The fake sampler: output ``i`` of a request depends only on (request id, i)."""
    digest = hashlib.blake2b(f"{request_id}:{output_index}".encode(), digest_size=4).digest()
    return 10 + int.from_bytes(digest, "little") % 1000


def expected_outputs(request_id: str, max_tokens: int, stop: tuple[int, ...] = ()) -> list[int]:
    outputs: list[int] = []
    for index in range(max_tokens):
        outputs.append(token_for(request_id, index))
        if outputs[-1] in stop:
            break
    return outputs


def make_request(
    request_id: str, prompt_len: int, max_tokens: int = 6, stop: tuple[int, ...] = ()
) -> Request:
    prompt = [1 + (len(request_id) * 31 + 7 * i) % 97 for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, stop_token_ids=stop))


class Cluster:
    """A fake prefill side and model around one ``DecodeScheduler``.

    Transfers write the reserved pages of a simulated KV pool; each decode step writes its input
    token and reads the whole context back through the page table, so a page shared, lost or
    reused too early shows up as a wrong context. Pages are blanked when first handed to a
    request, so nothing reads stale data. ``check_integrity`` runs after every call.
    """

    def __init__(self, **config: Any) -> None:
        config.setdefault("num_pages", 64)
        config.setdefault("max_model_len", 256)
        config.setdefault("kv_wait_timeout_s", TIMEOUT_S)
        self.scheduler = DecodeScheduler(DecodeSchedulerConfig(page_size=PAGE, **config))
        self.now = 0.0
        self.kv: dict[tuple[int, int], int] = {}
        self.page_tables: dict[str, list[int]] = {}
        self.transfers: dict[str, Reservation] = {}
        self.prefill_prompts: list[tuple[str, list[int]]] = []
        self.finished: dict[str, DecodeFinished] = {}
        self.preempted: list[str] = []

    def check(self) -> None:
        self.scheduler.check_integrity()

    def add(self, *requests: Request) -> None:
        for request in requests:
            self.scheduler.add_request(request)
            assert self.scheduler.status(request.request_id) is RequestStatus.WAITING
        self.check()

    def reserve(self) -> list[Reservation]:
        reservations = self.scheduler.reserve(self.now)
        for reservation in reservations:
            rid = reservation.request_id
            request = self.scheduler.get(rid)
            assert request is not None and request.page_ids == list(reservation.page_ids)
            assert len(reservation.page_ids) * PAGE >= reservation.num_prompt_tokens
            assert reservation.deadline_s == self.now + TIMEOUT_S
            self._blank(reservation.page_ids)
            self.page_tables[rid] = list(reservation.page_ids)
            self.transfers[rid] = reservation
            self.prefill_prompts.append((rid, request.all_token_ids[: reservation.num_prompt_tokens]))
        self.check()
        return reservations

    def deliver(
        self, rid: str, first_token: int | None = None, cached_tokens: int = 0
    ) -> DecodeFinished | None:
        """The prefill computes the reserved prompt, writes it and notifies."""
        reservation = self.transfers.pop(rid)
        request = self.scheduler.get(rid)
        assert request is not None and request.page_ids == list(reservation.page_ids), (
            "pages freed under a write"
        )
        for position, token in enumerate(request.all_token_ids[: reservation.num_prompt_tokens]):
            self.kv[reservation.page_ids[position // PAGE], position % PAGE] = token
        token = token_for(rid, 0) if first_token is None else first_token
        record = self.scheduler.kv_arrived(rid, token, cached_tokens, attempt=reservation.attempt)
        self._record(record)
        self.check()
        return record

    def fail(self, rid: str, retry: bool, reason: str = "prefill rank p0 died") -> DecodeFinished | None:
        reservation = self.transfers.pop(rid)
        record = self.scheduler.kv_failed(rid, reason, retry, attempt=reservation.attempt)
        self._record(record)
        self.check()
        return record

    def step(self) -> SchedulerOutput:
        output = self.scheduler.schedule()
        self.check()
        self.preempted.extend(output.preempted_request_ids)
        sampled: dict[str, int] = {}
        for chunk in output.chunks:
            rid = chunk.request_id
            request = self.scheduler.get(rid)
            assert request is not None and request.status == RequestStatus.RUNNING
            assert chunk.sample and chunk.token_ids == (request.all_token_ids[-1],)
            assert chunk.start_position == request.num_tokens - 1
            assert chunk.output_index == len(request.output_token_ids)
            known = self.page_tables[rid]
            assert list(chunk.page_ids[: len(known)]) == known, "a running request's pages moved"
            self._blank(chunk.page_ids[len(known) :])
            self.page_tables[rid] = list(chunk.page_ids)
            position = chunk.start_position
            self.kv[chunk.page_ids[position // PAGE], position % PAGE] = chunk.token_ids[0]
            context = [self.kv[chunk.page_ids[p // PAGE], p % PAGE] for p in range(position + 1)]
            assert context == request.all_token_ids, f"KV of {rid} read back wrong"
            sampled[rid] = token_for(rid, chunk.output_index)
        for record in self.scheduler.update(output, sampled):
            self._record(record)
        self.check()
        return output

    def drain(self, max_iterations: int = 10_000) -> None:
        """Reserve, deliver every transfer and step until nothing is left."""
        for _ in range(max_iterations):
            if not self.scheduler.has_unfinished_requests():
                return
            self.reserve()
            for rid in list(self.transfers):
                self.deliver(rid)
            self.step()
        raise AssertionError("requests did not finish")

    def fork(self, child: Request, parent_id: str) -> bool:
        """``child`` on ``parent_id``'s prompt pages, the copies made in the simulated pool."""
        copies = self.scheduler.fork(child, parent_id)
        if copies is not None:
            for src, dst in copies:
                for slot in range(PAGE):
                    if (src, slot) in self.kv:
                        self.kv[dst, slot] = self.kv[src, slot]
                    else:
                        self.kv.pop((dst, slot), None)
            self.page_tables[child.request_id] = list(child.page_ids)
        self.check()
        return copies is not None

    def abort(self, rid: str) -> AbortAction:
        result = self.scheduler.abort(rid)
        self._record(result.finished)
        assert (result.finished is not None) == (result.action is AbortAction.DONE)
        self.check()
        return result.action

    def assert_all_free(self) -> None:
        assert not self.scheduler.has_unfinished_requests()
        assert self.scheduler.num_free_pages == self.scheduler.config.num_pages

    def _blank(self, page_ids: Any) -> None:
        for page_id in page_ids:
            for slot in range(PAGE):
                self.kv.pop((page_id, slot), None)

    def _record(self, record: DecodeFinished | None) -> None:
        if record is None:
            return
        assert record.request_id not in self.finished, "finished twice"
        assert record.request.is_finished and record.request.page_ids == []
        assert self.scheduler.get(record.request_id) is None
        assert (record.error is not None) == (record.finish_reason == "error")
        assert record.request.finish_reason == record.finish_reason
        self.finished[record.request_id] = record


# -- config and validation ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_pages", 0),
        ("page_size", -1),
        ("max_num_seqs", 0),
        ("max_model_len", 1),
        ("kv_wait_timeout_s", 0.0),
        ("kv_wait_timeout_s", float("inf")),
        ("max_reservations_in_flight", 0),
        ("max_kv_retries", -1),
        ("max_kv_retries", True),
    ],
)
def test_config_names_the_bad_field(field: str, value: object) -> None:
    kwargs: dict[str, Any] = {"num_pages": 8, "max_model_len": 64, field: value}
    with pytest.raises(ValueError, match=field):
        DecodeSchedulerConfig(**kwargs)


def test_add_request_rejects_what_can_never_run() -> None:
    cluster = Cluster(num_pages=4, max_model_len=32)
    cases = [
        (make_request("empty", 0), "prompt"),
        (make_request("long", 32), "prompt"),
        (make_request("huge", 10, max_tokens=20), "prompt"),  # 29 KV tokens: 8 pages > 4
        (Request("bad", [1], SamplingParams(max_tokens=0)), "max_tokens"),
    ]
    for request, field in cases:
        with pytest.raises(InvalidRequestError) as info:
            cluster.scheduler.add_request(request)
        assert info.value.field == field
    cluster.add(make_request("a", 3))
    with pytest.raises(InvalidRequestError, match="request_id"):
        cluster.scheduler.add_request(make_request("a", 3))
    assert cluster.scheduler.num_queued == 1
    cluster.check()


# -- lifecycle --------------------------------------------------------------------------------------


def test_full_lifecycle() -> None:
    cluster = Cluster()
    scheduler = cluster.scheduler
    cluster.add(make_request("a", 6, max_tokens=5))
    assert (scheduler.num_queued, scheduler.num_waiting_for_kv, scheduler.num_running) == (1, 0, 0)

    cluster.now = 100.0
    [reservation] = cluster.reserve()
    assert reservation.num_prompt_tokens == 6 and len(reservation.page_ids) == 2
    assert reservation.deadline_s == 105.0 and reservation.attempt == 0
    assert reservation.destination("decode-0", 3) == KVDestination("decode-0", 3, reservation.page_ids)
    assert scheduler.status("a") is RequestStatus.WAITING_FOR_KV
    assert scheduler.get("a").status == RequestStatus.WAITING_FOR_KV  # type: ignore[union-attr]
    assert scheduler.num_free_pages == 62 and scheduler.num_waiting_for_kv == 1
    assert cluster.prefill_prompts == [("a", make_request("a", 6).prompt_token_ids)]
    assert scheduler.schedule().is_empty  # nothing runs before its KV

    assert cluster.deliver("a", cached_tokens=4) is None
    request = scheduler.get("a")
    assert request is not None and scheduler.status("a") is RequestStatus.RUNNING
    assert request.status == RequestStatus.RUNNING
    assert request.output_token_ids == [token_for("a", 0)]
    assert (request.num_computed_tokens, request.num_cached_tokens) == (6, 4)

    output = cluster.step()
    [chunk] = output.chunks
    assert (chunk.start_position, chunk.output_index, len(chunk.page_ids)) == (6, 1, 2)
    assert output.num_batched_tokens == 1 and output.preempted_request_ids == ()
    output = cluster.step()
    assert len(output.chunks[0].page_ids) == 2  # position 7 still fits page 1
    output = cluster.step()
    assert len(output.chunks[0].page_ids) == 3  # position 8 opens page 2
    cluster.step()
    record = cluster.finished["a"]
    assert record.finish_reason == "length" and record.error is None and record.num_kv_retries == 0
    assert record.request.output_token_ids == expected_outputs("a", 5)
    assert record.request.num_cached_tokens == 4
    cluster.assert_all_free()


def test_small_pool_queues_requests_and_finishes_them_all() -> None:
    cluster = Cluster(num_pages=6)
    requests = [make_request(f"r{i}", 3 + (i * 5) % 9, max_tokens=3 + i % 5) for i in range(12)]
    cluster.add(*requests)
    max_queued_while_busy = 0
    for _ in range(1000):
        if not cluster.scheduler.has_unfinished_requests():
            break
        cluster.reserve()
        if cluster.scheduler.num_running + cluster.scheduler.num_waiting_for_kv:
            max_queued_while_busy = max(max_queued_while_busy, cluster.scheduler.num_queued)
        for rid in list(cluster.transfers):
            cluster.deliver(rid)
        cluster.step()
    assert max_queued_while_busy >= 8
    for request in requests:
        record = cluster.finished[request.request_id]
        assert record.finish_reason == "length"
        assert record.request.output_token_ids == expected_outputs(
            request.request_id, request.sampling.max_tokens
        )
    cluster.assert_all_free()


def test_queue_head_blocks_the_requests_behind_it() -> None:
    cluster = Cluster(num_pages=4)
    cluster.add(make_request("a", 8, max_tokens=1), make_request("b", 12, max_tokens=1))
    cluster.add(make_request("c", 2, max_tokens=1))
    assert [r.request_id for r in cluster.reserve()] == ["a"]
    assert cluster.scheduler.num_free_pages == 2  # "c" would fit, but "b" is first
    assert cluster.reserve() == []
    assert cluster.deliver("a") is not None  # max_tokens=1: finished by its first token
    assert [r.request_id for r in cluster.reserve()] == ["b", "c"]
    cluster.drain()
    cluster.assert_all_free()


def test_max_reservations_in_flight() -> None:
    cluster = Cluster(max_reservations_in_flight=2)
    cluster.add(*(make_request(f"r{i}", 5) for i in range(5)))
    assert [r.request_id for r in cluster.reserve()] == ["r0", "r1"]
    assert cluster.reserve() == []
    assert cluster.scheduler.num_waiting_for_kv == 2 and cluster.scheduler.num_queued == 3
    cluster.deliver("r0")
    assert [r.request_id for r in cluster.reserve()] == ["r2"]
    cluster.fail("r1", retry=False)
    assert [r.request_id for r in cluster.reserve()] == ["r3"]
    cluster.drain()
    assert cluster.finished["r1"].finish_reason == "error"
    assert {r.finish_reason for rid, r in cluster.finished.items() if rid != "r1"} == {"length"}
    cluster.assert_all_free()


@pytest.mark.parametrize("kind", ["max_tokens", "stop", "eos"])
def test_first_token_can_finish_the_request(kind: str) -> None:
    cluster = Cluster()
    first = token_for("a", 0)
    request = {
        "max_tokens": make_request("a", 5, max_tokens=1),
        "stop": make_request("a", 5, stop=(first,)),
        "eos": dataclasses.replace(make_request("a", 5), eos_token_ids=frozenset({first})),
    }[kind]
    cluster.add(request)
    cluster.reserve()
    record = cluster.deliver("a")
    assert record is not None
    assert record.finish_reason == ("length" if kind == "max_tokens" else "stop")
    assert record.request.output_token_ids == [first]
    assert cluster.step().is_empty
    cluster.assert_all_free()


def test_stop_token_in_decode() -> None:
    cluster = Cluster()
    stop = token_for("a", 3)
    cluster.add(make_request("a", 5, max_tokens=10, stop=(stop,)))
    cluster.drain()
    record = cluster.finished["a"]
    assert record.finish_reason == "stop" and record.request.output_token_ids[-1] == stop
    assert record.request.output_token_ids == expected_outputs("a", 10, (stop,))
    cluster.assert_all_free()


def test_running_beyond_max_num_seqs_wait_their_turn_in_arrival_order() -> None:
    cluster = Cluster(max_num_seqs=2)
    cluster.add(make_request("a", 3, max_tokens=2), make_request("b", 3, max_tokens=4))
    cluster.add(make_request("c", 3, max_tokens=2))
    cluster.reserve()
    for rid in ("c", "b", "a"):  # KV arrives out of order
        cluster.deliver(rid)
    assert [c.request_id for c in cluster.step().chunks] == ["a", "b"]  # "a" finishes
    assert [c.request_id for c in cluster.step().chunks] == ["b", "c"]
    cluster.drain()
    cluster.assert_all_free()


# -- deadlines, failures, retries ------------------------------------------------------------------


def test_expired_transfer_is_retried_at_the_front_and_then_succeeds() -> None:
    cluster = Cluster(max_reservations_in_flight=1)
    scheduler = cluster.scheduler
    cluster.add(make_request("a", 6, max_tokens=3), make_request("b", 6, max_tokens=3))
    [first] = cluster.reserve()
    free_pages = scheduler.num_free_pages
    cluster.now = TIMEOUT_S - 0.1
    assert scheduler.expired(cluster.now) == []
    cluster.now = TIMEOUT_S
    assert scheduler.expired(cluster.now) == ["a"]
    assert scheduler.expired(cluster.now + 1) == []  # reported once
    assert scheduler.num_free_pages == free_pages  # a write may still land: pages stay reserved
    cluster.check()

    assert cluster.fail("a", retry=True) is None  # the transport reports the abort complete
    assert scheduler.status("a") is RequestStatus.WAITING and scheduler.num_free_pages == free_pages + 2
    [second] = cluster.reserve()
    assert second.request_id == "a" and second.attempt == 1  # back at the front, ahead of "b"
    assert second.deadline_s == cluster.now + TIMEOUT_S
    # A notification of the first attempt arriving now is not taken for the second.
    assert scheduler.kv_arrived("a", 5, 0, attempt=first.attempt) is None
    assert scheduler.kv_failed("a", "late", retry=False, attempt=first.attempt) is None
    assert scheduler.status("a") is RequestStatus.WAITING_FOR_KV
    cluster.deliver("a")
    cluster.drain()
    assert cluster.finished["a"].num_kv_retries == 1
    assert cluster.finished["a"].request.output_token_ids == expected_outputs("a", 3)
    assert cluster.finished["b"].finish_reason == "length"
    cluster.assert_all_free()


@pytest.mark.parametrize("max_kv_retries", [0, 1, 3])
def test_retries_are_exhausted_into_an_error(max_kv_retries: int) -> None:
    cluster = Cluster(max_kv_retries=max_kv_retries)
    cluster.add(make_request("a", 6))
    for _ in range(max_kv_retries):
        cluster.reserve()
        assert cluster.fail("a", retry=True) is None
    cluster.reserve()
    record = cluster.fail("a", retry=True, reason="no prefill rank answers")
    assert record is not None and record.finish_reason == "error"
    assert record.error is not None and "no prefill rank answers" in record.error
    assert record.num_kv_retries == max_kv_retries
    cluster.assert_all_free()


def test_failure_without_retry_is_an_error() -> None:
    cluster = Cluster()
    cluster.add(make_request("a", 6))
    cluster.reserve()
    record = cluster.fail("a", retry=False, reason="prompt rejected by prefill")
    assert record is not None and record.finish_reason == "error"
    assert record.error == "prompt rejected by prefill"
    cluster.assert_all_free()


def test_bad_notification_is_rejected_naming_the_field() -> None:
    cluster = Cluster()
    cluster.add(make_request("a", 6))
    cluster.reserve()
    with pytest.raises(KVNotificationError, match="cached_tokens"):
        cluster.scheduler.kv_arrived("a", 12, 7)
    with pytest.raises(KVNotificationError, match="first_token"):
        cluster.scheduler.kv_arrived("a", -1, 0)
    assert cluster.scheduler.status("a") is RequestStatus.WAITING_FOR_KV
    cluster.check()


# -- aborts ---------------------------------------------------------------------------------------


def test_abort_in_each_state() -> None:
    cluster = Cluster(num_pages=8, max_reservations_in_flight=2)
    scheduler = cluster.scheduler
    cluster.add(make_request("running", 7, max_tokens=20), make_request("waiting", 8))
    cluster.add(make_request("queued", 4), make_request("victim", 4, max_tokens=20))

    cluster.reserve()  # "running" (2 pages), "waiting" (2 pages)
    cluster.deliver("running")
    assert scheduler.status("queued") is RequestStatus.WAITING
    assert cluster.abort("queued") is AbortAction.DONE
    assert cluster.finished["queued"].finish_reason == "abort"

    assert cluster.abort("waiting") is AbortAction.CANCEL_TRANSFER
    assert cluster.abort("waiting") is AbortAction.CANCEL_TRANSFER  # idempotent until the transfer ends
    assert scheduler.status("waiting") is RequestStatus.WAITING_FOR_KV and scheduler.num_free_pages == 4
    cluster.now = 2 * TIMEOUT_S
    assert scheduler.expired(cluster.now) == []  # already being cancelled
    record = cluster.fail("waiting", retry=True)  # the cancelled transfer reports its end
    assert record is not None and record.finish_reason == "abort" and record.error is None
    assert scheduler.num_free_pages == 6

    [reservation] = cluster.reserve()
    assert reservation.request_id == "victim"
    cluster.deliver("victim")
    while "victim" not in cluster.preempted:  # "running" grows until "victim" is preempted
        cluster.step()
    assert scheduler.status("victim") is RequestStatus.PREEMPTED
    assert scheduler.get("victim").status == RequestStatus.PREEMPTED  # type: ignore[union-attr]
    assert cluster.abort("victim") is AbortAction.DONE
    assert cluster.finished["victim"].finish_reason == "abort"
    assert cluster.finished["victim"].request.output_token_ids  # outputs are kept in the record

    assert scheduler.status("running") is RequestStatus.RUNNING
    assert cluster.abort("running") is AbortAction.DONE
    assert cluster.abort("running") is AbortAction.UNKNOWN
    assert cluster.abort("never-seen") is AbortAction.UNKNOWN
    assert cluster.step().is_empty
    cluster.assert_all_free()


def test_late_notifications_after_abort_are_ignored() -> None:
    cluster = Cluster()
    scheduler = cluster.scheduler
    cluster.add(make_request("a", 5), make_request("b", 5), make_request("c", 5))
    cluster.reserve()
    assert cluster.abort("a") is AbortAction.CANCEL_TRANSFER
    cluster.fail("a", retry=False)
    assert scheduler.kv_arrived("a", 11, 0) is None  # the notification raced the abort: dropped
    assert scheduler.kv_failed("a", "again", retry=True) is None

    # The write landed before the cancel took effect: the notification ends it as an abort.
    assert cluster.abort("b") is AbortAction.CANCEL_TRANSFER
    record = cluster.deliver("b")
    assert record is not None and record.finish_reason == "abort"
    assert record.request.output_token_ids == []
    assert scheduler.kv_failed("b", "cancel completed", retry=False) is None

    cluster.deliver("c")
    assert cluster.abort("c") is AbortAction.DONE
    assert scheduler.kv_arrived("c", 11, 0) is None
    assert [cluster.finished[r].finish_reason for r in "abc"] == ["abort"] * 3
    cluster.assert_all_free()


def test_abort_between_schedule_and_update_skips_the_chunk() -> None:
    cluster = Cluster()
    scheduler = cluster.scheduler
    cluster.add(make_request("a", 5), make_request("b", 5))
    cluster.reserve()
    cluster.deliver("a")
    cluster.deliver("b")
    output = scheduler.schedule()
    assert cluster.abort("a") is AbortAction.DONE
    assert scheduler.update(output, {"a": 1, "b": token_for("b", 1)}) == []
    assert scheduler.get("b").output_token_ids == expected_outputs("b", 2)  # type: ignore[union-attr]
    cluster.check()


def test_stale_or_incomplete_update_is_rejected() -> None:
    cluster = Cluster()
    scheduler = cluster.scheduler
    cluster.add(make_request("a", 5))
    cluster.reserve()
    cluster.deliver("a")
    output = scheduler.schedule()
    with pytest.raises(StaleSchedulerOutputError, match="no sampled token"):
        scheduler.update(output, {})
    scheduler.update(output, {"a": token_for("a", 1)})
    with pytest.raises(StaleSchedulerOutputError, match="starts at"):
        scheduler.update(output, {"a": token_for("a", 1)})
    cluster.check()


# -- preemption -----------------------------------------------------------------------------------


def test_preempted_request_is_recomputed_and_continues_identically() -> None:
    cluster = Cluster(num_pages=5)
    scheduler = cluster.scheduler
    cluster.add(make_request("old", 4, max_tokens=10), make_request("new", 5, max_tokens=8))
    cluster.reserve()
    cluster.deliver("old", cached_tokens=2)
    cluster.deliver("new", cached_tokens=4)
    while not cluster.preempted:
        cluster.step()
    assert cluster.preempted == ["new"]
    victim = scheduler.get("new")
    assert victim is not None and victim.page_ids == [] and victim.num_preemptions == 1
    assert scheduler.status("new") is RequestStatus.PREEMPTED and scheduler.num_queued == 1
    outputs_before = list(victim.output_token_ids)
    assert outputs_before

    reservations: list[Reservation] = []
    while not reservations:
        cluster.step()
        reservations = cluster.reserve()
    [reservation] = reservations
    victim = scheduler.get("new")
    assert victim is not None and victim.output_token_ids == outputs_before  # nothing decoded meanwhile
    assert reservation.num_prompt_tokens == victim.num_tokens - 1
    assert cluster.prefill_prompts[-1] == ("new", victim.all_token_ids[:-1])
    assert victim.status == RequestStatus.WAITING_FOR_KV  # its recomputed KV is on the way

    assert cluster.deliver("new", first_token=999, cached_tokens=0) is None  # the re-sampled token is ignored
    assert victim.output_token_ids == outputs_before and victim.num_cached_tokens == 4
    assert victim.num_computed_tokens == victim.num_tokens - 1
    cluster.drain()

    reference = Cluster()
    reference.add(make_request("old", 4, max_tokens=10), make_request("new", 5, max_tokens=8))
    reference.drain()
    assert reference.preempted == []
    for rid in ("old", "new"):
        assert (
            cluster.finished[rid].request.output_token_ids == reference.finished[rid].request.output_token_ids
        )
    cluster.assert_all_free()


def test_request_needing_a_page_preempts_itself_when_newest() -> None:
    cluster = Cluster(num_pages=3)
    cluster.add(make_request("a", 4, max_tokens=3), make_request("b", 4, max_tokens=3))
    cluster.reserve()  # one page each
    cluster.deliver("a")
    cluster.deliver("b")
    output = cluster.step()  # both need a second page; one is free
    assert [c.request_id for c in output.chunks] == ["a"]
    assert output.preempted_request_ids == ("b",)
    assert cluster.scheduler.status("b") is RequestStatus.PREEMPTED
    cluster.drain()
    assert cluster.finished["b"].request.output_token_ids == expected_outputs("b", 3)
    cluster.assert_all_free()


def test_two_requests_that_do_not_fit_together_take_turns_instead_of_preempting_each_other() -> None:
    """Six pages; "a" grows to five, "b" to six; each recomputation takes two steps to arrive.
    Once "b" is preempted, it reserves again only when its pages fit beside what "a" still grows
    into: while "a" runs, "b" stays queued (no reservation, so "a" is not preempted in turn), and
    both finish after one preemption. Before, "b"'s reservation took the page "a" needed next, so
    "a" preempted itself, then the same the other way round: each re-prefilled before it made a
    token, forever."""
    cluster = Cluster(num_pages=6)
    scheduler = cluster.scheduler
    cluster.add(make_request("a", 4, max_tokens=16), make_request("b", 8, max_tokens=16))
    waited: dict[str, int] = {}
    for _ in range(200):
        if not scheduler.has_unfinished_requests():
            break
        cluster.reserve()
        for rid in list(cluster.transfers):  # the prefill delivers a transfer two steps later
            waited[rid] = waited.get(rid, 0) + 1
            if waited[rid] > 2:
                del waited[rid]
                cluster.deliver(rid)
        if cluster.preempted and scheduler.status("a") is RequestStatus.RUNNING:
            assert scheduler.status("b") is RequestStatus.PREEMPTED  # the wait: "b" holds back
        cluster.step()
    assert not scheduler.has_unfinished_requests(), cluster.preempted[:10]
    assert cluster.preempted == ["b"]
    for rid in ("a", "b"):
        assert cluster.finished[rid].request.output_token_ids == expected_outputs(rid, 16)
    cluster.assert_all_free()


# -- everything at once ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(6))
def test_random_scenario(seed: int) -> None:
    rng = random.Random(seed)
    cluster = Cluster(num_pages=12, max_num_seqs=4, max_reservations_in_flight=3, max_kv_retries=2)
    scheduler = cluster.scheduler
    specs: dict[str, tuple[int, tuple[int, ...]]] = {}
    pending = [f"r{i}" for i in range(40)]
    stalled: set[str] = set()  # transfers that never notify
    cancelling: dict[str, float] = {}  # transfers being aborted -> when the abort completes
    for _ in range(5000):
        if not pending and not scheduler.has_unfinished_requests():
            break
        cluster.now += rng.choice([0.5, 1.0, 2.0])
        for _ in range(rng.randint(0, 2)):
            if pending:
                rid = pending.pop(0)
                max_tokens = rng.randint(1, 12)
                stop = (token_for(rid, rng.randrange(max_tokens)),) if rng.random() < 0.3 else ()
                specs[rid] = (max_tokens, stop)
                cluster.add(make_request(rid, rng.randint(1, 15), max_tokens, stop))
        for reservation in cluster.reserve():
            if rng.random() < 0.15:
                stalled.add(reservation.request_id)
        for rid in scheduler.expired(cluster.now):
            cancelling[rid] = cluster.now + rng.choice([0.0, 1.0, 3.0])
        for rid in list(cluster.transfers):
            if rid in cancelling:
                if cluster.now >= cancelling[rid]:
                    del cancelling[rid]
                    if rid not in stalled and rng.random() < 0.3:
                        cluster.deliver(rid)  # the write landed before the cancel took effect
                    else:
                        stalled.discard(rid)
                        cluster.fail(rid, retry=rng.random() < 0.7, reason="transfer timed out")
            elif rid not in stalled and rng.random() < 0.6:
                if rng.random() < 0.1:
                    cluster.fail(rid, retry=rng.random() < 0.5)
                else:
                    cluster.deliver(rid)
        if rng.random() < 0.15 and scheduler.has_unfinished_requests():
            rid = rng.choice([r for r in specs if r not in cluster.finished])
            if cluster.abort(rid) is AbortAction.CANCEL_TRANSFER and rid not in cancelling:
                cancelling[rid] = cluster.now + rng.choice([0.0, 2.0])
        cluster.step()
    else:
        raise AssertionError("the scenario did not finish")

    assert set(cluster.finished) == set(specs)
    reasons = {record.finish_reason for record in cluster.finished.values()}
    assert {"abort", "length"} <= reasons
    for rid, record in cluster.finished.items():
        expected = expected_outputs(rid, *specs[rid])
        outputs = record.request.output_token_ids
        if record.finish_reason in ("stop", "length"):
            assert outputs == expected
        else:
            assert outputs == expected[: len(outputs)]
    assert cluster.preempted, "the pool should be small enough to preempt"
    cluster.assert_all_free()


def test_decode_scheduler_does_not_import_torch() -> None:
    code = (
        "import sys, tandem.decode.scheduler; "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules, 'torch imported'; "
        "assert 'tandem.kvtransfer.nixl_transport' not in sys.modules and 'nixl' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- forks ------------------------------------------------------------------------------------------


def _sibling(parent: Request, request_id: str, max_tokens: int = 6) -> Request:
    return Request(request_id, list(parent.prompt_token_ids), SamplingParams(max_tokens=max_tokens))


def _running(cluster: Cluster, request: Request) -> None:
    cluster.add(request)
    cluster.reserve()
    cluster.deliver(request.request_id)


@pytest.mark.parametrize("prompt_len", [9, 8, 1], ids=["mid-page", "page-end", "one-token"])
def test_forked_requests_share_the_prompt_pages_and_each_reads_its_own_context(prompt_len: int) -> None:
    """Two children on a running parent's prompt: the pages before the prompt's last position
    are shared, the page holding it is copied; every step of the three reads its own context
    back (the parent's writes after the fork land in its own page, not in theirs)."""
    cluster = Cluster()
    parent = make_request("p", prompt_len, max_tokens=8)
    _running(cluster, parent)
    cluster.step()  # the parent has written past its prompt before the children come
    free = cluster.scheduler.num_free_pages
    children = [_sibling(parent, f"c{i}") for i in (1, 2)]
    assert all(cluster.fork(c, "p") for c in children)
    last = (prompt_len - 1) // PAGE
    assert cluster.scheduler.num_free_pages == free - 2  # one page each
    for child in children:
        assert child.page_ids[:last] == parent.page_ids[:last] and child.status is RequestStatus.RUNNING
        assert child.page_ids[last] not in parent.page_ids
    if last:
        assert cluster.scheduler.kv_cache.refcount(parent.page_ids[0]) == 3
    cluster.drain()
    for rid, n in (("p", 8), ("c1", 6), ("c2", 6)):
        assert cluster.finished[rid].request.output_token_ids == expected_outputs(rid, n)
    cluster.assert_all_free()


def test_a_fork_is_refused_unless_its_parent_runs_here_with_the_same_prompt() -> None:
    cluster = Cluster()
    parent = make_request("p", 10)
    cluster.add(parent)
    free = cluster.scheduler.num_free_pages
    assert not cluster.fork(_sibling(parent, "early"), "p")  # queued: no KV yet
    cluster.reserve()
    assert not cluster.fork(_sibling(parent, "waiting"), "p")  # waiting for its KV
    cluster.deliver("p")
    free = cluster.scheduler.num_free_pages
    assert not cluster.fork(_sibling(parent, "x"), "nobody")
    other = make_request("o", 11)
    assert not cluster.fork(Request("other", list(other.prompt_token_ids), SamplingParams()), "p")
    resumed = _sibling(parent, "resumed")
    resumed.output_token_ids = [5]
    assert not cluster.fork(resumed, "p")
    assert not cluster.fork(_sibling(parent, "p"), "p")  # its own id
    assert cluster.scheduler.num_free_pages == free and cluster.scheduler.num_running == 1
    full = Cluster(num_pages=4)
    big = make_request("big", 12, max_tokens=4)  # 3 pages, a fourth at its first step
    _running(full, big)
    full.step()
    assert full.scheduler.num_free_pages == 0
    assert not full.fork(_sibling(big, "c", max_tokens=4), "big")  # no page for its copy


def test_the_parent_aborted_before_a_childs_first_step_leaves_it_the_shared_pages() -> None:
    cluster = Cluster()
    parent = make_request("p", 13)
    _running(cluster, parent)
    child = _sibling(parent, "c")
    assert cluster.fork(child, "p")
    shared = child.page_ids[0]
    assert cluster.abort("p") is AbortAction.DONE
    assert cluster.scheduler.kv_cache.refcount(shared) == 1  # the child's now
    cluster.drain()
    assert cluster.finished["c"].request.output_token_ids == expected_outputs("c", 6)
    cluster.assert_all_free()


def test_a_preempted_fork_is_prefilled_as_any_request() -> None:
    """A forked child preempted before or after its first token gives its pages back (the
    shared ones stay with the parent) and comes back through a prefill of its own."""
    cluster = Cluster(num_pages=7)
    parent = make_request("p", 9, max_tokens=12)  # 3 pages, growing to 6
    _running(cluster, parent)
    child = _sibling(parent, "c", max_tokens=12)
    assert cluster.fork(child, "p")
    cluster.drain()
    assert cluster.preempted == ["c"]  # the newest, when the parent's next token needed a page
    assert [rid for rid, _ in cluster.prefill_prompts] == ["p", "c"]  # the child's own prefill
    for rid in ("p", "c"):
        assert cluster.finished[rid].request.output_token_ids == expected_outputs(rid, 12)
    cluster.assert_all_free()
