from __future__ import annotations

import hashlib
import math
import random
import subprocess
import sys
from array import array
from collections.abc import Sequence
from dataclasses import replace

import pytest

from tandem.engine.prefix_cache import block_hashes
from tandem.engine.request import RequestStatus
from tandem.engine.scheduler_output import SchedulerOutput, StaleSchedulerOutputError
from tandem.kvtransfer.types import KVDestination
from tandem.prefill.scheduler import AbortAction, PrefillScheduler, PrefillSchedulerConfig, PrefillStateError
from tandem.wire.kv_events import BlockRemoved, BlockStored
from tandem.wire.prefill_job import PrefillDone, PrefillJob
from tandem.wire.request_params import InvalidRequestError, SamplingParams
from tests.simulated_kv import SimulatedKV

PAGE = 4


def next_token(context: Sequence[int], output_index: int) -> int:
    """The fake model: a hash of the whole context (read back from the KV) and the output index."""
    digest = hashlib.blake2b(array("q", [*context, output_index]).tobytes(), digest_size=4).digest()
    return 10 + int.from_bytes(digest, "little") % 1000


def make_job(
    rid: str, prompt: Sequence[int], deadline_s: float = 1e9, output_index: int = 0, max_tokens: int = 8
) -> PrefillJob:
    num_pages = math.ceil(len(prompt) / PAGE)
    return PrefillJob(
        request_id=rid,
        prompt_token_ids=tuple(prompt),
        sampling=SamplingParams(max_tokens=max_tokens),
        output_index=output_index,
        destination=KVDestination("decode-0", 1, tuple(range(500, 500 + num_pages))),
        deadline_s=deadline_s,
    )


class Rank:
    """A scheduler, a fake clock and a fake runner that writes each chunk's tokens into a simulated
    KV pool through the page table. Every finished job's transfer is checked by reading the prompt
    back from its ``src_page_ids``, so a wrong or overwritten page (cached or not) is caught."""

    def __init__(self, **overrides: int | bool) -> None:
        settings: dict[str, int | bool] = {
            "num_pages": 32,
            "page_size": PAGE,
            "max_num_seqs": 8,
            "max_num_batched_tokens": 16,
            "max_model_len": 256,
            "vocab_size": 1000,
        }
        settings.update(overrides)
        self.scheduler = PrefillScheduler(PrefillSchedulerConfig(**settings))  # type: ignore[arg-type]
        self.now = 0.0
        self.kv = SimulatedKV(PAGE)
        self.jobs: dict[str, PrefillJob] = {}
        self.done: dict[str, PrefillDone] = {}

    def add(self, job: PrefillJob) -> None:
        self.scheduler.add_job(job, self.now)
        self.jobs[job.request_id] = job
        self.scheduler.check_integrity()

    def run(self, plan: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        for chunk in plan.chunks:
            assert len(chunk.page_ids) == math.ceil((chunk.start_position + len(chunk.token_ids)) / PAGE)
            context = self.kv.write(chunk, self.scheduler.kv_cache)
            if context is not None:
                sampled[chunk.request_id] = next_token(context, chunk.output_index)
        return sampled

    def step(self) -> tuple[SchedulerOutput, list[PrefillDone]]:
        plan = self.scheduler.schedule(self.now)
        self.scheduler.check_integrity()
        sampled = self.run(plan)
        self.now += 1.0
        done = self.scheduler.update(plan, sampled, self.now)
        self.scheduler.check_integrity()
        for result in done:
            job = self.jobs[result.request_id]
            prompt = job.prompt_token_ids
            assert len(result.src_page_ids) == len(job.destination.page_ids)
            sent = [self.kv.slots[result.src_page_ids[p // PAGE], p % PAGE] for p in range(len(prompt))]
            assert sent == list(prompt), f"{result.request_id}: the pages to send do not hold the prompt"
            assert result.first_token == next_token(prompt, job.output_index)
            self.done[result.request_id] = result
        return plan, done

    def transfer_over(self, rid: str) -> None:
        assert self.scheduler.transfer_over(rid)
        self.scheduler.check_integrity()


def shapes(plan: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(c.request_id, c.start_position, len(c.token_ids), c.sample) for c in plan.chunks]


def test_long_prompt_is_chunked_under_the_budget_and_only_the_last_chunk_samples() -> None:
    rank = Rank(max_num_batched_tokens=8)
    prompt = list(range(1, 22))
    rank.add(make_job("a", prompt))
    plans = []
    while rank.scheduler.has_work():
        plan, _ = rank.step()
        plans.append(plan)
    expected = [("a", 0, 8, False), ("a", 8, 8, False), ("a", 16, 5, True)]
    assert [s for p in plans for s in shapes(p)] == expected
    assert [p.num_batched_tokens for p in plans] == [8, 8, 5]
    assert plans[1].chunks[0].token_ids == tuple(prompt[8:16])
    assert all(c.output_index == 0 and not p.preempted_request_ids for p in plans for c in p.chunks)
    done = rank.done["a"]
    assert done.cached_tokens == 0 and len(done.src_page_ids) == 6
    assert done.src_page_ids == plans[-1].chunks[0].page_ids
    assert (done.timings.queue_s, done.timings.compute_s) == (0.0, 3.0)
    # Each step stores the pages it filled, chained to the previous step's last one.
    hashes = block_hashes(prompt, PAGE)
    assert rank.scheduler.take_events() == [
        BlockStored(tuple(hashes[0:2]), None, PAGE),
        BlockStored(tuple(hashes[2:4]), hashes[1], PAGE),
        BlockStored(tuple(hashes[4:5]), hashes[3], PAGE),
    ]


def test_prefill_chunk_tokens_caps_a_jobs_chunk_and_a_capped_chunk_ends_the_plan() -> None:
    rank = Rank(max_num_batched_tokens=16, prefill_chunk_tokens=6)
    rank.add(make_job("a", list(range(1, 15))))
    rank.add(make_job("b", list(range(100, 104))))
    plans = []
    while rank.scheduler.has_work():
        plan, _ = rank.step()
        plans.append(shapes(plan))
    # a's 14 tokens in chunks of 6: a cut chunk ends the plan, so b waits for a's last one
    assert plans == [[("a", 0, 6, False)], [("a", 6, 6, False)], [("a", 12, 2, True), ("b", 0, 4, True)]]
    assert set(rank.done) == {"a", "b"}


def test_several_jobs_share_one_step() -> None:
    rank = Rank(max_num_batched_tokens=24)
    for rid, length in (("a", 7), ("b", 9), ("c", 5), ("d", 6)):
        rank.add(make_job(rid, [length * 10 + i for i in range(length)]))
    plan, done = rank.step()
    assert shapes(plan) == [("a", 0, 7, True), ("b", 0, 9, True), ("c", 0, 5, True), ("d", 0, 3, False)]
    assert [d.request_id for d in done] == ["a", "b", "c"]
    assert (rank.scheduler.num_computing, rank.scheduler.num_transferring) == (1, 3)
    plan, done = rank.step()
    assert shapes(plan) == [("d", 3, 3, True)] and [d.request_id for d in done] == ["d"]


def test_max_num_seqs_caps_the_batch() -> None:
    rank = Rank(max_num_seqs=2)
    for rid in "abc":
        rank.add(make_job(rid, [ord(rid), 1, 2]))
    plan, _ = rank.step()
    assert [c.request_id for c in plan.chunks] == ["a", "b"]
    plan, _ = rank.step()
    assert [c.request_id for c in plan.chunks] == ["c"]


def test_a_shared_prefix_is_reused_and_its_pages_are_sent() -> None:
    rank = Rank()
    base = list(range(1, 11))  # 2 full pages + 2 tokens
    rank.add(make_job("a", base))
    rank.step()
    a_pages = rank.done["a"].src_page_ids
    rank.add(make_job("b", [*base[:8], 77, 78, 79]))
    rank.add(make_job("c", base[:8]))  # capped: one token is left to compute
    plan, _ = rank.step()
    chunks = {c.request_id: c for c in plan.chunks}
    assert chunks["b"].start_position == 8 and chunks["c"].start_position == 4
    b, c = rank.done["b"], rank.done["c"]
    assert (b.cached_tokens, c.cached_tokens) == (8, 4)
    assert b.src_page_ids[:2] == a_pages[:2] and len(b.src_page_ids) == 3
    assert c.src_page_ids[0] == a_pages[0] and c.src_page_ids[1] not in a_pages
    cache = rank.scheduler.kv_cache
    assert cache.refcount(a_pages[0]) == 3 and cache.refcount(a_pages[1]) == 2  # all three transferring
    assert (rank.scheduler.num_queried_tokens, rank.scheduler.num_hit_tokens) == (10 + 11 + 8, 12)
    for rid in "abc":
        rank.transfer_over(rid)
    assert rank.scheduler.num_free_pages == 32


def test_pages_are_held_while_transferring_and_released_by_transfer_over() -> None:
    rank = Rank()
    prompt = list(range(1, 11))
    rank.add(make_job("a", prompt))
    rank.step()
    scheduler, cache = rank.scheduler, rank.scheduler.kv_cache
    pages = rank.done["a"].src_page_ids
    assert scheduler.status("a") == RequestStatus.SENDING_KV
    assert scheduler.num_transferring == 1 and scheduler.num_free_pages == 32 - 3
    assert all(cache.refcount(p) == 1 for p in pages)
    assert scheduler.take_events() == [BlockStored(tuple(block_hashes(prompt, PAGE)), None, PAGE)]
    rank.transfer_over("a")
    assert scheduler.status("a") is None and scheduler.num_transferring == 0
    assert [cache.is_cached(p) for p in pages] == [True, True, False]
    assert cache.num_evictable_pages == 2 and scheduler.num_free_pages == 32
    assert scheduler.take_events() == []  # still cached: nothing is removed until evicted
    assert not scheduler.transfer_over("a")  # a duplicate report is ignored


def test_evicting_cached_pages_reports_their_removal() -> None:
    rank = Rank(num_pages=4, max_num_batched_tokens=64)
    first = list(range(1, 9))
    rank.add(make_job("a", first))
    rank.step()
    rank.transfer_over("a")
    rank.scheduler.take_events()
    rank.add(make_job("b", list(range(100, 116))))  # needs the whole pool
    rank.step()
    events = rank.scheduler.take_events()
    assert BlockRemoved(tuple(reversed(block_hashes(first, PAGE)))) in events


def test_jobs_wait_for_pages_and_all_complete_once_transfers_finish() -> None:
    rank = Rank(num_pages=6, max_num_batched_tokens=16)
    for i in range(5):
        rank.add(make_job(f"r{i}", [100 * (i + 1) + t for t in range(10)]))  # 3 pages each
    plan, _ = rank.step()
    # r1's first chunk is cut to the 3 pages left; the plan ends there.
    assert shapes(plan) == [("r0", 0, 10, True), ("r1", 0, 6, False)]
    plan, _ = rank.step()
    assert shapes(plan) == [("r1", 6, 4, True)]
    assert rank.scheduler.num_free_pages == 0
    plan, _ = rank.step()
    assert plan.is_empty and rank.scheduler.has_work() and rank.scheduler.num_queued == 3
    in_transfer = ["r0", "r1"]
    while rank.scheduler.has_work() or in_transfer:
        rank.transfer_over(in_transfer.pop(0))  # one transfer finishes per step
        _, done = rank.step()
        in_transfer.extend(d.request_id for d in done)
    assert sorted(rank.done) == [f"r{i}" for i in range(5)]
    assert rank.scheduler.num_free_pages == 6


def test_a_job_whose_deadline_passes_while_queued_is_dropped() -> None:
    rank = Rank(num_pages=3, max_num_batched_tokens=64)
    rank.add(make_job("a", list(range(1, 13))))  # the whole pool
    rank.add(make_job("late", list(range(20, 25)), deadline_s=2.5))
    rank.add(make_job("ok", list(range(30, 35)), deadline_s=100.0))
    rank.step()
    plan, _ = rank.step()
    assert plan.is_empty and rank.scheduler.take_expired() == []
    rank.now = 3.0
    plan, _ = rank.step()
    assert plan.is_empty
    (expired,) = rank.scheduler.take_expired()
    assert (expired.request_id, expired.deadline_s, expired.queue_s) == ("late", 2.5, 3.0)
    assert expired.destination == rank.jobs["late"].destination and "late" in expired.message
    assert rank.scheduler.status("late") is None and rank.scheduler.num_queued == 1
    rank.transfer_over("a")
    plan, _ = rank.step()
    assert [c.request_id for c in plan.chunks] == ["ok"]
    assert rank.done["ok"].timings.queue_s == 4.0


def test_a_deadline_passing_mid_prefill_does_not_drop_the_job() -> None:
    rank = Rank(max_num_batched_tokens=4)
    rank.add(make_job("a", list(range(1, 10)), deadline_s=1.5))
    for _ in range(3):
        rank.step()
    assert "a" in rank.done and rank.scheduler.take_expired() == []


def test_abort_in_each_state() -> None:
    rank = Rank(max_num_batched_tokens=8)
    scheduler = rank.scheduler
    assert scheduler.abort("nobody") == AbortAction.UNKNOWN
    rank.add(make_job("done", list(range(1, 6))))
    rank.step()
    rank.add(make_job("mid", list(range(10, 30))))
    rank.add(make_job("queued", list(range(40, 45))))
    rank.step()
    assert scheduler.status("mid") == RequestStatus.RUNNING
    assert scheduler.abort("queued") == AbortAction.DEQUEUED and scheduler.num_queued == 0
    plan = scheduler.schedule(rank.now)  # a chunk of "mid" in flight when it is aborted
    sampled = rank.run(plan)
    with pytest.raises(PrefillStateError, match="RUNNING"):
        scheduler.transfer_over("mid")
    assert scheduler.abort("mid") == AbortAction.STOPPED
    scheduler.check_integrity()
    assert scheduler.update(plan, sampled, rank.now) == []
    scheduler.check_integrity()
    assert scheduler.num_computing == 0 and scheduler.num_free_pages == 32 - 2
    assert scheduler.abort("done") == AbortAction.ABORT_TRANSFER
    assert scheduler.status("done") == RequestStatus.SENDING_KV and scheduler.num_free_pages == 30
    rank.transfer_over("done")
    assert scheduler.abort("done") == AbortAction.UNKNOWN and scheduler.num_free_pages == 32
    assert not scheduler.has_work()


def test_plans_must_be_applied_once_in_order() -> None:
    rank = Rank(max_num_batched_tokens=4)
    rank.add(make_job("a", list(range(1, 10))))
    plan = rank.scheduler.schedule(rank.now)
    with pytest.raises(StaleSchedulerOutputError, match="in flight"):
        rank.scheduler.schedule(rank.now)
    rank.scheduler.update(plan, {}, rank.now)
    with pytest.raises(StaleSchedulerOutputError, match="not the one planned"):
        rank.scheduler.update(plan, {}, rank.now)
    rank.scheduler.update(rank.scheduler.schedule(rank.now), {}, rank.now)
    last = rank.scheduler.schedule(rank.now)
    assert shapes(last) == [("a", 8, 1, True)]
    with pytest.raises(StaleSchedulerOutputError, match="no sampled token"):
        rank.scheduler.update(last, {}, rank.now)


def test_a_re_prefill_samples_its_output_index() -> None:
    rank = Rank()
    rank.add(make_job("a", list(range(1, 12)), output_index=3))
    plan, _ = rank.step()
    assert plan.chunks[0].output_index == 3
    assert rank.done["a"].first_token == next_token(list(range(1, 12)), 3)


def test_prefix_caching_off_caches_nothing() -> None:
    rank = Rank(enable_prefix_caching=False, max_num_batched_tokens=32)
    for rid in "ab":
        rank.add(make_job(rid, list(range(1, 11))))
    rank.step()
    assert [rank.done[r].cached_tokens for r in "ab"] == [0, 0]
    assert not set(rank.done["a"].src_page_ids) & set(rank.done["b"].src_page_ids)
    assert rank.scheduler.take_events() == []


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"destination": KVDestination("decode-0", 1, (1, 2))}, "destination.page_ids"),
        ({"destination": KVDestination("decode-0", 1, (1, 2, 2))}, "destination.page_ids"),
        ({"prompt_token_ids": ()}, "prompt_token_ids"),
        ({"prompt_token_ids": (1, 2, 1000)}, "prompt_token_ids"),
        ({"prompt_token_ids": (1, -2, 3)}, "prompt_token_ids"),
        ({"prompt_token_ids": [1, 2, 3]}, "prompt_token_ids"),
        ({"request_id": ""}, "request_id"),
        ({"output_index": -1}, "output_index"),
        ({"output_index": 8}, "output_index"),
        ({"sampling": SamplingParams(temperature=-1.0)}, "temperature"),
        ({"sampling": SamplingParams(temperature=1.0)}, "seed"),  # samples, with no seed
        ({"deadline_s": float("nan")}, "deadline_s"),
    ],
)
def test_invalid_jobs_name_the_field(change: dict[str, object], field: str) -> None:
    rank = Rank()
    job = replace(make_job("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]), **change)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequestError) as error:
        rank.add(job)
    assert error.value.field == field
    assert rank.scheduler.num_queued == 0


def test_too_long_and_duplicate_jobs_are_rejected() -> None:
    rank = Rank(num_pages=4, max_model_len=20)
    with pytest.raises(InvalidRequestError, match="context of 20") as too_long:
        rank.add(make_job("a", list(range(20))))
    with pytest.raises(InvalidRequestError, match="only 4") as too_big:
        rank.add(make_job("a", list(range(17))))
    assert too_long.value.field == too_big.value.field == "prompt_token_ids"
    rank.add(make_job("a", list(range(16))))
    with pytest.raises(InvalidRequestError) as duplicate:
        rank.add(make_job("a", list(range(3))))
    assert duplicate.value.field == "request_id"


@pytest.mark.parametrize(
    ("setting", "value"),
    [
        ("num_pages", 0),
        ("page_size", -1),
        ("max_num_seqs", 0),
        ("max_num_batched_tokens", 0),
        ("max_model_len", 1),
        ("vocab_size", 0),
    ],
)
def test_config_names_a_bad_field(setting: str, value: int) -> None:
    settings = {"num_pages": 8, "max_model_len": 64, setting: value}
    with pytest.raises(ValueError, match=setting):
        PrefillSchedulerConfig(**settings)  # type: ignore[arg-type]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_jobs_aborts_and_out_of_order_transfers(seed: int) -> None:
    rng = random.Random(seed)
    rank = Rank(num_pages=12, max_num_batched_tokens=rng.choice([5, 8, 16]), max_num_seqs=4)
    scheduler = rank.scheduler
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(4, 17))] for _ in range(3)]
    aborted: set[str] = set()
    expired: set[str] = set()
    in_transfer: list[str] = []
    for n in range(300):
        if n < 200 and rng.random() < 0.4:
            prompt = [*rng.choice(prefixes), *(rng.randrange(1000) for _ in range(rng.randrange(0, 20)))]
            prompt = prompt[: 12 * PAGE]
            deadline = rank.now + rng.choice([2.0, 50.0, 1e9])
            rank.add(make_job(f"j{n}", prompt, deadline_s=deadline))
        _, done = rank.step()
        in_transfer.extend(d.request_id for d in done)
        expired.update(e.request_id for e in scheduler.take_expired())
        if n < 200 and rng.random() < 0.1:
            rid = rng.choice([r for r in rank.jobs if scheduler.status(r) is not None] or ["nobody"])
            action = scheduler.abort(rid)
            if action != AbortAction.UNKNOWN:
                aborted.add(rid)
            if action == AbortAction.STOPPED:
                scheduler.check_integrity()
        rng.shuffle(in_transfer)
        while in_transfer and (rng.random() < 0.5 or n >= 200):
            rank.transfer_over(in_transfer.pop())
    assert not scheduler.has_work() and scheduler.num_transferring == 0
    assert scheduler.num_free_pages == scheduler.kv_cache.num_total_pages == 12
    assert set(rank.jobs) == set(rank.done) | aborted | expired
    assert expired and aborted and any(d.cached_tokens for d in rank.done.values())


def test_prefill_scheduler_does_not_import_torch() -> None:
    code = (
        "import sys, tandem.prefill.scheduler, tandem.wire.prefill_job; "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
