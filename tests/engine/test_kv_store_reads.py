"""The store is read off the loop thread: a job whose blocks it is asked for waits while the
others step, gets its hit once the answer is in, and a store slower than recomputing is a miss
and left alone for a while. The writer's close is bounded too."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from tandem.engine.kv_store_io import StoreWriter
from tandem.engine.kv_tiers import KVTiers, TierConfig, TierPrices
from tandem.engine.request import RequestStatus
from tandem.kvtransfer.kv_store import StoreError
from tandem.prefill.scheduler import PrefillScheduler, PrefillSchedulerConfig
from tests.engine.test_kv_tiers import LAYOUT, PAGE, PAGE_BYTES, SECRET, compute, tiered_cache, write_through
from tests.kv_store_double import DictStore
from tests.prefill.test_scheduler import make_job

ANSWER_S = 1.5  # how long the store takes to answer a read, unless the test lets it answer


class SlowStore(DictStore):
    """Each read answers after ``ANSWER_S``, or as soon as ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.release.set()
        self.reads = self.answered = 0

    def _slow(self) -> None:
        self.reads += 1
        self.release.wait(ANSWER_S)
        self.answered += 1

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._slow()
        return super().exists(keys)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        self._slow()
        return super().get_many(keys)


def _stored(store: SlowStore, *prompts: list[int]) -> None:
    """Another rank computed ``prompts``: their blocks are in the store."""
    cache, tiers = tiered_cache(num_pages=16, store=store)
    for prompt in prompts:
        compute(cache, prompt)
    write_through(tiers, store)


def _scheduler(store: SlowStore, prices: TierPrices) -> tuple[PrefillScheduler, KVTiers]:
    tiers = KVTiers(
        TierConfig(0, store, "m", LAYOUT, PAGE_BYTES, store_timeout_s=2.0, prices=prices, secret=SECRET)
    )
    config = PrefillSchedulerConfig(
        num_pages=16, page_size=PAGE, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64
    )
    return PrefillScheduler(config, tiers), tiers


def _wait_for(condition, timeout_s: float = 3.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def test_other_jobs_step_while_one_waits_on_the_store_and_it_gets_its_hit_after() -> None:
    store = SlowStore()
    prompt = list(range(50, 59))  # 2 full pages + 1
    _stored(store, prompt)
    scheduler, tiers = _scheduler(store, TierPrices(prefill_tokens_per_s=1.0))  # waiting pays
    store.release.clear()
    reads, answered = store.reads, store.answered
    scheduler.add_job(make_job("a", prompt), 0.0)
    for i in range(4):  # four steps while the store holds its answer back
        scheduler.add_job(make_job(f"b{i}", [7, 8, 9]), 0.0)  # no full page: nothing to ask
        plan = scheduler.schedule(0.0)
        # the loop thread never waits on the store: had it, "a" would be in the plan (a miss)
        assert [c.request_id for c in plan.chunks] == [f"b{i}"]
        assert scheduler.status("a") is RequestStatus.WAITING
        scheduler.update(plan, {f"b{i}": 1}, 0.0)
        scheduler.transfer_over(f"b{i}")
    _wait_for(lambda: store.reads == reads + 1)  # asked once (its reader thread's call)...
    assert store.answered == answered  # ... still unanswered
    assert not scheduler.has_work()  # only the waiting job: the loop idles, it does not spin

    store.release.set()
    _wait_for(scheduler.has_work)
    plan = scheduler.schedule(0.0)
    assert [(c.request_id, c.start_position) for c in plan.chunks] == [("a", 2 * PAGE)]
    (done,) = scheduler.update(plan, {"a": 1}, 0.0)
    assert done.cached_store_tokens == 2 * PAGE and tiers.store_errors == 0
    fills = [op for op in tiers.take_ops() if op.kind == "fill"]
    assert len(fills) == 2
    scheduler.transfer_over("a")
    scheduler.check_integrity()


def test_a_store_slower_than_recomputing_is_a_miss_and_is_backed_off() -> None:
    store = SlowStore()
    prompt, later = list(range(60, 69)), list(range(70, 79))
    _stored(store, prompt, later)
    # recomputing a's 2 blocks (8 tokens) is priced at 0.2 s: the store's 1.5 s is too slow
    scheduler, tiers = _scheduler(store, TierPrices(prefill_tokens_per_s=40.0))
    store.release.clear()
    scheduler.add_job(make_job("a", prompt), 0.0)
    assert not scheduler.schedule(0.0).chunks  # waits (had the loop waited, a would be computed now)
    time.sleep(0.45)  # past the price (0.2 s) and the answer's slack (0.1 s), the store still silent
    plan = scheduler.schedule(0.0)
    assert [(c.request_id, c.start_position) for c in plan.chunks] == [("a", 0)]  # a miss: computed
    # a miss, counted as slow (not as a failure), and the store is backed off
    assert tiers.store_slow == 1 and tiers.stats().store_slow == 1 and tiers.stats().store_errors == 0
    scheduler.update(plan, {"a": 1}, 0.0)
    scheduler.transfer_over("a")

    reads = store.reads
    scheduler.add_job(make_job("c", later), 0.0)  # in the store too, but the store is backed off
    plan = scheduler.schedule(0.0)
    assert [(c.request_id, c.start_position) for c in plan.chunks] == [("c", 0)]
    assert store.reads == reads
    store.release.set()
    scheduler.check_integrity()


def test_jobs_that_arrive_together_wait_one_round_trip_not_one_each(monkeypatch) -> None:
    """Each read takes 0.3 s and a fetch is a miss after 2 s: four fetches asked one after the
    other would take 2.4 s and the last would miss; asked together they all hit."""
    import tests.engine.test_kv_store_reads as this

    monkeypatch.setattr(this, "ANSWER_S", 0.3)
    store = SlowStore()
    prompts = [list(range(100 * i, 100 * i + 9)) for i in range(1, 5)]
    _stored(store, *prompts)
    scheduler, tiers = _scheduler(store, TierPrices(prefill_tokens_per_s=1.0))
    store.release.clear()
    reads = store.reads
    for i, prompt in enumerate(prompts):
        scheduler.add_job(make_job(f"j{i}", prompt), 0.0)
    cached: dict[str, int] = {}
    start = time.monotonic()
    while len(cached) < 4 and time.monotonic() - start < 5:
        plan = scheduler.schedule(0.0)
        for chunk in plan.chunks:
            cached.setdefault(chunk.request_id, chunk.start_position)
        for done in scheduler.update(plan, {c.request_id: 1 for c in plan.chunks if c.sample}, 0.0):
            scheduler.transfer_over(done.request_id)
        time.sleep(0.005)
    assert cached == {f"j{i}": 2 * PAGE for i in range(4)} and tiers.store_errors == 0
    assert store.reads - reads <= 4  # at most two batches of one exists and one get_many each
    store.release.set()
    scheduler.check_integrity()


class HungStore(DictStore):
    def __init__(self) -> None:
        super().__init__()
        self.writing = threading.Event()
        self.never = threading.Event()

    def put(self, key: str, value: bytes) -> None:
        self.writing.set()
        self.never.wait()
        raise StoreError("gave up")


def test_the_writer_closes_within_a_bound_when_its_thread_hangs_on_a_full_queue() -> None:
    store = HungStore()
    writer = StoreWriter(store, max_queued=2)
    writer.submit(1, "k1", b"1")
    assert store.writing.wait(2.0)  # the thread is stuck in the store
    assert writer.submit(2, "k2", b"2") and writer.submit(3, "k3", b"3")
    assert not writer.submit(4, "k4", b"4") and writer.dropped == 1  # full: dropped, never blocks
    closing = threading.Thread(target=writer.close, daemon=True)
    start = time.monotonic()
    closing.start()
    closing.join(4.0)
    assert not closing.is_alive() and time.monotonic() - start < 4.0
    store.never.set()
