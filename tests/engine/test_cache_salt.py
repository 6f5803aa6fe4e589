"""A cache salt keeps one tenant's prefixes from another's: it is mixed into a prompt's chain at
its root, so every place that names a prompt's blocks (the prefix cache and its events, the host
tier and the store, the colocated and prefill schedulers, the decode rank's write-back and its
prefill affinity) sees salted hashes. No salt gives today's hashes exactly."""

from __future__ import annotations

import math
from dataclasses import replace

from tandem.decode.dispatch import RayPrefillDispatcher
from tandem.engine.page_allocator import PageAllocator
from tandem.engine.prefix_cache import PrefixCache, block_hash, block_hashes, chain_root, prompt_chain
from tandem.engine.request import Request
from tandem.engine.scheduler import Scheduler, SchedulerConfig
from tandem.kvtransfer.types import KVDestination
from tandem.prefill.scheduler import PrefillScheduler, PrefillSchedulerConfig
from tandem.wire.kv_events import BlockStored
from tandem.wire.messages import RankId, RankRequest
from tandem.wire.prefill_job import PrefillJob
from tandem.wire.request_params import SamplingParams
from tests.engine.test_kv_tiers import tiered_cache
from tests.engine.test_scheduler import FakeRunner
from tests.kv_store_double import DictStore

PAGE = 4
PROMPT = list(range(40, 53))  # 3 full pages + 1 token


def _run(cache: PrefixCache, tokens: list[int], salt: str | None) -> int:
    """A request through the cache as a scheduler runs it; the tokens it found cached."""
    found = cache.match(tokens, cache_salt=salt)
    pages = found.page_ids + (cache.allocate(math.ceil(len(tokens) / PAGE) - len(found.page_ids)) or [])
    cache.cache_full_pages(tokens, pages, len(tokens), cache_salt=salt)
    cache.free(pages)
    return found.num_tokens


def test_no_salt_is_todays_chain_and_a_salt_changes_every_block() -> None:
    plain = block_hashes(PROMPT, PAGE)
    assert chain_root(None) is None and block_hashes(PROMPT, PAGE, None) == plain
    assert plain[0] == block_hash(None, PROMPT[:PAGE])  # unsalted deployments keep their hashes
    salted = block_hashes(PROMPT, PAGE, "tenant-a")
    assert salted[0] == block_hash(chain_root("tenant-a"), PROMPT[:PAGE])
    assert not set(salted) & set(plain) and not set(salted) & set(block_hashes(PROMPT, PAGE, "tenant-b"))
    chain = prompt_chain(PROMPT, PAGE, "tenant-a")
    assert [c.block for c in chain] == salted and chain[0].parent == chain_root("tenant-a")
    assert [c.parent for c in chain[1:]] == salted[:-1] and chain[2].tokens == tuple(PROMPT[8:12])


def test_the_device_cache_shares_a_prefix_only_under_the_same_salt_and_reports_salted_events() -> None:
    cache = PrefixCache(PageAllocator(16), PAGE)
    assert _run(cache, PROMPT, "a") == 0
    stored = cache.take_events()
    assert stored == [BlockStored(tuple(block_hashes(PROMPT, PAGE, "a")), chain_root("a"), PAGE)]
    assert _run(cache, PROMPT, "b") == 0  # another tenant's salt: nothing shared
    assert _run(cache, PROMPT, None) == 0  # nor without a salt
    assert _run(cache, PROMPT, "a") == 12  # the same salt shares every full page it may
    assert _run(cache, PROMPT, None) == 12  # and unsalted requests share among themselves
    cache.check_integrity()


def test_the_host_tier_and_the_store_hold_salted_blocks() -> None:
    store = DictStore()
    cache, tiers = tiered_cache(num_pages=8, store=store)
    assert _run(cache, PROMPT, "a") == 0
    written = {op.block for op in tiers.take_ops() if op.kind == "write"}
    assert written == set(block_hashes(PROMPT, PAGE, "a"))  # the store's keys are the salted blocks

    cache, tiers = tiered_cache(num_pages=4, host_pages=8)
    prompt = PROMPT[:9]  # 2 full pages + 1 token
    _run(cache, prompt, "a")
    cache.take_events()
    _run(cache, list(range(200, 216)), None)  # 4 pages: evicts both of the salted prompt's
    hosted = {
        h
        for e in cache.take_events()
        if isinstance(e, BlockStored) and e.tier == "host"
        for h in e.block_hashes
    }
    assert set(block_hashes(prompt, PAGE, "a")) <= hosted
    found = cache.match(prompt, cache_salt="b")
    assert found.num_tokens == 0  # another salt finds nothing in the host tier
    found = cache.match(prompt, cache_salt="a")
    assert (found.device_tokens, found.host_tokens) == (0, 8)
    cache.free(found.page_ids)
    cache.check_integrity()


def test_the_colocated_scheduler_shares_only_under_the_same_salt() -> None:
    scheduler = Scheduler(
        SchedulerConfig(
            num_pages=64, page_size=PAGE, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=256
        )
    )
    runner = FakeRunner(scheduler)
    cached = {}
    for rid, salt in [("first", "a"), ("other", "b"), ("same", "a")]:
        request = Request(rid, list(PROMPT), SamplingParams(max_tokens=2), cache_salt=salt)
        scheduler.add_request(request)
        while not request.is_finished:
            plan = scheduler.schedule()
            scheduler.update(plan, runner.run(plan))
            scheduler.check_integrity()
        cached[rid] = request.num_cached_tokens
    assert cached == {"first": 0, "other": 0, "same": 12}


def _job(rid: str, salt: str | None) -> PrefillJob:
    return PrefillJob(
        request_id=rid,
        prompt_token_ids=tuple(PROMPT),
        sampling=SamplingParams(max_tokens=4),
        destination=KVDestination("decode-0", 1, tuple(range(4))),
        deadline_s=1e9,
        cache_salt=salt,
    )


def test_the_prefill_scheduler_shares_only_under_the_same_salt() -> None:
    scheduler = PrefillScheduler(
        PrefillSchedulerConfig(
            num_pages=32,
            page_size=PAGE,
            max_num_seqs=8,
            max_num_batched_tokens=64,
            max_model_len=256,
            vocab_size=100,
        )
    )
    cached, now = {}, 0.0
    for rid, salt in [("first", "a"), ("other", "b"), ("plain", None), ("same", "a")]:
        job = _job(rid, salt)
        job.validate(100, 256, PAGE)
        scheduler.add_job(job, now)
        plan = scheduler.schedule(now)
        done = scheduler.update(plan, {c.request_id: 1 for c in plan.chunks if c.sample}, now + 1)
        scheduler.check_integrity()
        cached[rid] = done[0].cached_tokens
        assert scheduler.transfer_over(rid)
        now += 2
    assert cached == {"first": 0, "other": 0, "plain": 0, "same": 12}


def test_a_salt_travels_on_the_wire_and_picks_the_prefill_affinity() -> None:
    assert RankRequest("r", (1, 2), SamplingParams(max_tokens=1), cache_salt="a").cache_salt == "a"
    assert replace(_job("r", None), cache_salt="a").cache_salt == "a"
    dispatcher = RayPrefillDispatcher(PAGE)
    dispatcher.set_ranks({RankId(f"prefill{i}", 0): object() for i in range(7)})
    ranks = {
        salt: dispatcher.choose(Request("r", list(PROMPT), SamplingParams(max_tokens=1), cache_salt=salt))
        for salt in ["a", "b", "c", "d", "e", "f"]
    }
    assert len(set(ranks.values())) > 1  # the salted first block picks: tenants spread out
    expected = sorted(dispatcher.ranks)[block_hash(chain_root("a"), PROMPT[:PAGE]) % 7]
    assert ranks["a"] == expected
