from __future__ import annotations

import hashlib
import random
import subprocess
import sys
from array import array
from collections.abc import Callable, Sequence

import pytest

from tandem.engine.prefix_cache import block_hashes
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Scheduler, SchedulerConfig
from tandem.engine.scheduler_output import SchedulerOutput, StaleSchedulerOutputError
from tandem.wire.kv_events import BlockStored
from tandem.wire.request_params import InvalidRequestError, SamplingParams
from tests.simulated_kv import SimulatedKV

PAGE = 4


def next_token(context: Sequence[int]) -> int:
    """The fake model: the next token is a hash of the whole context, read back from the KV."""
    digest = hashlib.blake2b(array("q", context).tobytes(), digest_size=4).digest()
    return 10 + int.from_bytes(digest, "little") % 1000


def reference(prompt: list[int], max_tokens: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(max_tokens):
        tokens.append(next_token(tokens))
    return tokens[len(prompt) :]


class FakeRunner:
    """Writes each chunk's tokens into a simulated KV pool through the page table and samples
    from the context read back from it, so wrong or overwritten pages change the outputs."""

    def __init__(self, scheduler: Scheduler, sample: Callable[[Sequence[int]], int] = next_token) -> None:
        self.scheduler = scheduler
        self.sample = sample
        self.kv = SimulatedKV(PAGE)

    def run(self, plan: SchedulerOutput) -> dict[str, int]:
        sampled = {}
        for chunk in plan.chunks:
            assert len(chunk.page_ids) * PAGE >= chunk.start_position + len(chunk.token_ids)
            context = self.kv.write(chunk, self.scheduler.kv_cache)
            if context is not None:
                sampled[chunk.request_id] = self.sample(context)
        return sampled


def make_scheduler(**overrides: int | bool) -> Scheduler:
    settings: dict[str, int | bool] = {
        "num_pages": 64,
        "page_size": PAGE,
        "max_num_seqs": 8,
        "max_num_batched_tokens": 16,
        "max_model_len": 256,
    }
    settings.update(overrides)
    return Scheduler(SchedulerConfig(**settings))  # type: ignore[arg-type]


def make_request(rid: str, prompt: list[int], max_tokens: int = 4, **sampling: object) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **sampling))  # type: ignore[arg-type]


def step(scheduler: Scheduler, runner: FakeRunner) -> tuple[SchedulerOutput, list[Request]]:
    plan = scheduler.schedule()
    scheduler.check_integrity()
    finished = scheduler.update(plan, runner.run(plan))
    scheduler.check_integrity()
    return plan, finished


def run_all(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 2000) -> dict[str, Request]:
    done: dict[str, Request] = {}
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        _, finished = step(scheduler, runner)
        done.update((r.request_id, r) for r in finished)
    assert not scheduler.has_unfinished_requests()
    cache = scheduler.kv_cache
    assert cache.num_free_pages == cache.num_total_pages
    return done


def test_chunked_prefill_splits_under_the_budget() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(scheduler)
    prompt = list(range(1, 21))
    scheduler.add_request(make_request("a", prompt, max_tokens=3))
    plans = []
    while scheduler.has_unfinished_requests():
        plan, _ = step(scheduler, runner)
        plans.append(plan)
    shapes = [(c.start_position, len(c.token_ids), c.sample, c.output_index) for p in plans for c in p.chunks]
    assert shapes == [
        (0, 8, False, 0),
        (8, 8, False, 0),
        (16, 4, True, 0),
        (20, 1, True, 1),
        (21, 1, True, 2),
    ]
    assert plans[1].chunks[0].token_ids == tuple(prompt[8:16])
    assert plans[3].chunks[0].token_ids == (next_token(prompt),)
    assert [p.num_batched_tokens for p in plans] == [8, 8, 4, 1, 1]


def test_prefill_chunk_tokens_caps_each_requests_chunk_and_the_tokens_are_the_same() -> None:
    """With ``prefill_chunk_tokens`` 5 a 12-token prompt computes 5, 5 and 2 tokens while another
    request shares the step's budget of 16; the outputs are those of an uncapped run."""
    scheduler = make_scheduler(prefill_chunk_tokens=5)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("a", list(range(1, 13)), max_tokens=3))
    scheduler.add_request(make_request("b", list(range(50, 59)), max_tokens=2))
    plans, done = [], {}
    while scheduler.has_unfinished_requests():
        plan, finished = step(scheduler, runner)
        plans.append([(c.request_id, len(c.token_ids)) for c in plan.chunks])
        done.update((r.request_id, r) for r in finished)
        scheduler.check_integrity()
    assert plans[:3] == [[("a", 5), ("b", 5)], [("a", 5), ("b", 4)], [("a", 2), ("b", 1)]]
    assert max(n for plan in plans for _, n in plan) == 5
    assert done["a"].output_token_ids == reference(list(range(1, 13)), 3)
    assert done["b"].output_token_ids == reference(list(range(50, 59)), 2)
    with pytest.raises(ValueError, match="prefill_chunk_tokens"):
        make_scheduler(prefill_chunk_tokens=0)


def test_budget_is_shared_running_first() -> None:
    scheduler = make_scheduler(max_num_batched_tokens=8)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("a", list(range(6)), max_tokens=3))
    scheduler.add_request(make_request("b", list(range(100, 106)), max_tokens=2))
    first, _ = step(scheduler, runner)
    assert [(c.request_id, len(c.token_ids), c.sample) for c in first.chunks] == [
        ("a", 6, True),
        ("b", 2, False),
    ]
    second, _ = step(scheduler, runner)
    assert [(c.request_id, len(c.token_ids), c.sample) for c in second.chunks] == [
        ("a", 1, True),
        ("b", 4, True),
    ]
    done = run_all(scheduler, runner)
    assert done["a"].output_token_ids == reference(list(range(6)), 3)


def test_max_num_seqs_limits_running() -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    runner = FakeRunner(scheduler)
    for rid, length in (("a", 3), ("b", 3), ("c", 3)):
        scheduler.add_request(make_request(rid, list(range(length)), max_tokens=length))
    plan, _ = step(scheduler, runner)
    assert [c.request_id for c in plan.chunks] == ["a", "b"]
    assert (scheduler.num_running, scheduler.num_waiting) == (2, 1)
    done = run_all(scheduler, runner)
    assert sorted(done) == ["a", "b", "c"]


def test_prefix_is_shared_and_reported() -> None:
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler)
    base = list(range(1, 11))  # 2 full pages + 2 tokens
    scheduler.add_request(make_request("a", base, max_tokens=8))
    plan, _ = step(scheduler, runner)
    a_pages = plan.chunks[0].page_ids
    assert scheduler.kv_cache.take_events() == [BlockStored(tuple(block_hashes(base, PAGE)), None, PAGE)]

    scheduler.add_request(make_request("b", [*base[:8], 77, 78, 79], max_tokens=3))
    scheduler.add_request(make_request("c", base[:8], max_tokens=3))  # capped: one token computes
    plan, _ = step(scheduler, runner)
    chunks = {c.request_id: c for c in plan.chunks}
    assert chunks["b"].start_position == 8 and chunks["b"].page_ids[:2] == a_pages[:2]
    assert chunks["c"].start_position == 4 and chunks["c"].token_ids == tuple(base[4:8])
    assert chunks["c"].page_ids[:1] == a_pages[:1] and chunks["c"].page_ids[1] != a_pages[1]
    assert scheduler.kv_cache.refcount(a_pages[0]) == 3
    b, c = scheduler.get_request("b"), scheduler.get_request("c")
    assert b is not None and c is not None
    assert (b.num_cached_tokens, c.num_cached_tokens) == (8, 4)

    done = run_all(scheduler, runner)
    assert done["a"].output_token_ids == reference(base, 8)
    assert done["b"].output_token_ids == reference([*base[:8], 77, 78, 79], 3)
    assert done["c"].output_token_ids == reference(base[:8], 3)
    assert scheduler.kv_cache.num_hit_tokens == 12


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_in_a_tiny_pool_gives_the_same_tokens(enable_prefix_caching: bool) -> None:
    prompts = {f"r{i}": [*range(20, 28), i, i] for i in range(5)}  # two shared pages each
    scheduler = make_scheduler(num_pages=6, enable_prefix_caching=enable_prefix_caching)
    runner = FakeRunner(scheduler)
    for rid, prompt in prompts.items():
        scheduler.add_request(make_request(rid, prompt, max_tokens=12))
    preempted: list[str] = []
    done: dict[str, Request] = {}
    while scheduler.has_unfinished_requests():
        plan, finished = step(scheduler, runner)
        assert not set(plan.preempted_request_ids) & {c.request_id for c in plan.chunks}
        preempted.extend(plan.preempted_request_ids)
        done.update((r.request_id, r) for r in finished)
    assert preempted, "the pool is meant to be too small for all requests at once"
    assert sum(r.num_preemptions for r in done.values()) == len(preempted)
    for rid, prompt in prompts.items():
        assert done[rid].output_token_ids == reference(prompt, 12)
        assert done[rid].finish_reason == "length"
    assert scheduler.kv_cache.num_free_pages == 6


def test_preempted_request_rematches_its_outputs() -> None:
    # 5 pages: "old" grows to 3, "new" preempts itself when it needs its 3rd at position 8.
    scheduler = make_scheduler(num_pages=5, max_num_batched_tokens=64)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("old", list(range(5)), max_tokens=8))
    scheduler.add_request(make_request("new", list(range(50, 55)), max_tokens=9))
    while (new := scheduler.get_request("new")) is not None and new.num_preemptions == 0:
        step(scheduler, runner)
    assert new is not None and new.status == RequestStatus.PREEMPTED and new.page_ids == []
    outputs_so_far = list(new.output_token_ids)
    assert len(outputs_so_far) == 4 and new.num_cached_tokens == 0
    resumed = None
    done: dict[str, Request] = {}
    while resumed is None:
        plan, finished = step(scheduler, runner)
        done.update((r.request_id, r) for r in finished)
        resumed = next((c for c in plan.chunks if c.request_id == "new"), None)
    # Prompt and the first three outputs fill two cached pages; only the fourth output computes.
    assert (resumed.start_position, resumed.token_ids) == (8, (outputs_so_far[3],))
    assert new.num_cached_tokens == 0 and "old" in done
    done.update(run_all(scheduler, runner))
    assert done["new"].output_token_ids == reference(list(range(50, 55)), 9)
    assert done["old"].output_token_ids == reference(list(range(5)), 8)


def test_abort_in_every_state_frees_everything() -> None:
    scheduler = make_scheduler(num_pages=4, max_num_batched_tokens=64)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("old", list(range(5)), max_tokens=9))
    scheduler.add_request(make_request("new", list(range(50, 55)), max_tokens=9))
    scheduler.add_request(make_request("queued", list(range(90, 96)), max_tokens=4))
    while (new := scheduler.get_request("new")) is not None and new.status != RequestStatus.PREEMPTED:
        step(scheduler, runner)
    queued = scheduler.get_request("queued")
    assert queued is not None and queued.status == RequestStatus.WAITING
    for rid in ("new", "queued"):
        assert scheduler.abort_request(rid)
        scheduler.check_integrity()
    assert new.status == queued.status == RequestStatus.FINISHED_ABORTED
    assert new.finish_reason == "abort"

    plan = scheduler.schedule()
    sampled = runner.run(plan)
    assert scheduler.abort_request("old")  # running, and in the step being run
    assert scheduler.update(plan, sampled) == []
    assert not scheduler.abort_request("old") and not scheduler.abort_request("missing")
    scheduler.check_integrity()
    cache = scheduler.kv_cache
    assert cache.num_free_pages == cache.num_total_pages and not scheduler.has_unfinished_requests()


def test_stop_conditions() -> None:
    scheduler = make_scheduler(max_model_len=12)
    runner = FakeRunner(scheduler, sample=lambda context: 7 if len(context) % 2 else 5)
    eos = frozenset({7})
    scheduler.add_request(Request("eos", [1, 2, 3], SamplingParams(max_tokens=5), eos_token_ids=eos))
    scheduler.add_request(
        Request("ignore", [1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True), eos_token_ids=eos)
    )
    scheduler.add_request(make_request("stop", [1, 2, 3], max_tokens=5, stop_token_ids=(5,)))
    scheduler.add_request(make_request("long", list(range(10)), max_tokens=50))
    done = run_all(scheduler, runner)
    assert (done["eos"].output_token_ids, done["eos"].finish_reason) == ([7], "stop")
    assert (done["ignore"].output_token_ids, done["ignore"].finish_reason) == ([7, 5, 7, 5, 7], "length")
    assert (done["stop"].output_token_ids, done["stop"].finish_reason) == ([7, 5], "stop")
    assert (done["long"].num_tokens, done["long"].finish_reason) == (12, "length")


def test_invalid_input_names_the_field() -> None:
    scheduler = make_scheduler(num_pages=4, max_model_len=64)
    cases = [
        (make_request("a", []), "prompt"),
        (make_request("a", list(range(64))), "prompt"),
        (make_request("a", [1, -2]), "prompt"),
        (make_request("a", list(range(10)), max_tokens=8), "prompt"),  # 17 KV tokens > 4 pages
        (make_request("a", [1], max_tokens=0), "max_tokens"),
        (make_request("a", [1], top_p=0.0), "top_p"),
    ]
    for request, field in cases:
        with pytest.raises(InvalidRequestError) as info:
            scheduler.add_request(request)
        assert info.value.field == field
    scheduler.add_request(make_request("a", list(range(10)), max_tokens=7))  # exactly 16 KV tokens fit
    with pytest.raises(InvalidRequestError, match="already in use"):
        scheduler.add_request(make_request("a", [1]))
    for field, value in (
        ("num_pages", 0),
        ("page_size", -1),
        ("max_num_batched_tokens", 0),
        ("max_model_len", 1),
    ):
        with pytest.raises(ValueError, match=field):
            make_scheduler(**{field: value})
    scheduler.check_integrity()


def test_an_output_applies_once() -> None:
    scheduler = make_scheduler()
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("a", [1, 2, 3]))
    plan = scheduler.schedule()
    sampled = runner.run(plan)
    scheduler.update(plan, sampled)
    with pytest.raises(StaleSchedulerOutputError, match="apply each output once"):
        scheduler.update(plan, sampled)
    with pytest.raises(StaleSchedulerOutputError, match="no sampled token"):
        scheduler.update(scheduler.schedule(), {})


def test_admission_evicts_cached_pages_when_nothing_runs() -> None:
    scheduler = make_scheduler(num_pages=4, max_num_batched_tokens=64)
    runner = FakeRunner(scheduler)
    scheduler.add_request(make_request("a", list(range(12)), max_tokens=1))
    run_all(scheduler, runner)
    assert scheduler.kv_cache.num_evictable_pages == 3
    scheduler.add_request(make_request("b", list(range(100, 112)), max_tokens=5))
    done = run_all(scheduler, runner)
    assert done["b"].output_token_ids == reference(list(range(100, 112)), 5)


@pytest.mark.parametrize(("seed", "enable_prefix_caching"), [(1234, True), (5, True), (77, False)])
def test_randomized_requests_aborts_and_tiny_pool(seed: int, enable_prefix_caching: bool) -> None:
    rng = random.Random(seed)
    scheduler = make_scheduler(
        num_pages=12,
        max_num_seqs=6,
        max_num_batched_tokens=12,
        max_model_len=40,
        enable_prefix_caching=enable_prefix_caching,
    )
    runner = FakeRunner(scheduler)
    bases = [[rng.randrange(1000) for _ in range(16)] for _ in range(3)]
    expected: dict[str, list[int]] = {}
    done: dict[str, Request] = {}
    aborted: set[str] = set()
    for index in range(80):
        if index < 60:
            suffix = [rng.randrange(1000) for _ in range(rng.randrange(8))]
            prompt = rng.choice(bases)[: rng.randrange(1, 17)] + suffix
            max_tokens = rng.randrange(1, 20)
            max_tokens = min(max_tokens, 12 * PAGE + 1 - len(prompt))
            rid = f"r{index}"
            scheduler.add_request(make_request(rid, prompt, max_tokens=max_tokens))
            expected[rid] = reference(prompt, max_tokens)[: 40 - len(prompt)]
        if rng.random() < 0.1:
            victim = rng.choice(sorted(expected))
            if scheduler.abort_request(victim):
                aborted.add(victim)
            scheduler.check_integrity()
        _, finished = step(scheduler, runner)
        done.update((r.request_id, r) for r in finished)
    done.update(run_all(scheduler, runner))
    assert set(done) | aborted == set(expected) and not set(done) & aborted
    for rid, request in done.items():
        assert request.output_token_ids == expected[rid]
    cache = scheduler.kv_cache
    assert cache.num_free_pages == cache.num_total_pages
    assert (cache.num_hit_tokens > 0) == enable_prefix_caching


def test_scheduling_core_does_not_import_torch() -> None:
    code = (
        "import sys, tandem.engine.scheduler, tandem.engine.prefix_cache, tandem.engine.page_allocator; "
        "assert 'torch' not in sys.modules and 'numpy' not in sys.modules"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
