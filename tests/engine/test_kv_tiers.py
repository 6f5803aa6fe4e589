"""The host tier and the store below a prefix cache: what moves, in which order, what is billed."""

from __future__ import annotations

import time

from tandem.engine.kv_block_codec import BlockLayout, StoredBlock, encode_block
from tandem.engine.kv_tiers import KVTiers, TierConfig, TierPrices
from tandem.engine.page_allocator import PageAllocator
from tandem.engine.prefix_cache import PrefixCache, block_hashes
from tandem.wire.kv_events import BlockRemoved, BlockStored
from tests.kv_store_double import DictStore

PAGE = 4
LAYOUT = BlockLayout(num_layers=2, page_size=PAGE, token_dim=3, dtype="float32")
PAGE_BYTES = 2 * PAGE * 3 * 4
SECRET = b"the deployment's secret"


def payload_of(block: int) -> bytes:
    return block.to_bytes(8, "little") * (PAGE_BYTES // 8)


def tiered_cache(
    num_pages: int, host_pages: int = 0, store: DictStore | None = None, prices=None, secret=SECRET
):
    tiers = KVTiers(
        TierConfig(
            host_pages=host_pages,
            store=store,
            model="m",
            layout=LAYOUT,
            page_bytes=PAGE_BYTES,
            # a prefill this slow makes every load worth it, whatever round trip a lookup
            # measures on a loaded machine: tests of the price rule pass prices of their own
            prices=prices or TierPrices(prefill_tokens_per_s=1.0),
            secret=secret,
        )
    )
    return PrefixCache(PageAllocator(num_pages), PAGE, tiers=tiers), tiers


def fetched_match(cache: PrefixCache, tokens: list[int]):
    """``match`` as a scheduler runs it: once the store's answer for ``tokens`` is in."""
    deadline = time.monotonic() + 5
    while cache.prefetch(tokens) is not None:
        assert time.monotonic() < deadline, "the store's fetch never ended"
        time.sleep(0.001)
    return cache.match(tokens)


def compute(cache: PrefixCache, tokens: list[int]) -> list[int]:
    """Take pages for ``tokens`` as a prefill would, compute them, free them (cached)."""
    found = fetched_match(cache, tokens)
    pages = found.page_ids + (cache.allocate(-(-len(tokens) // PAGE) - len(found.page_ids)) or [])
    cache.cache_full_pages(tokens, pages, len(tokens))
    cache.free(pages)
    return pages


def write_through(tiers: KVTiers, store: DictStore) -> None:
    """What the copier does with write ops: the page's bytes (here: named by its block), encoded."""
    for op in tiers.take_ops():
        if op.kind == "write":
            key, value = tiers.encode(op, payload_of(op.block))
            tiers.writer.submit(op.block, key, value)
    assert tiers.writer.flush()


def test_an_evicted_prefix_moves_to_the_host_tier_and_comes_back_from_it():
    cache, tiers = tiered_cache(num_pages=4, host_pages=8)
    a = list(range(100, 109))  # 2 full pages + 1 token
    a_pages = compute(cache, a)
    tiers.take_ops()
    cache.take_events()
    compute(cache, list(range(200, 216)))  # 4 pages: evicts both of a's
    ops = tiers.take_ops()
    saves = [op for op in ops if op.kind == "save"]
    assert sorted(op.page_id for op in saves) == sorted(a_pages[:2])
    events = cache.take_events()
    a_blocks = block_hashes(a, PAGE)
    removed = {
        h for e in events if isinstance(e, BlockRemoved) and e.tier == "device" for h in e.block_hashes
    }
    hosted = {h for e in events if isinstance(e, BlockStored) and e.tier == "host" for h in e.block_hashes}
    assert set(a_blocks) <= removed and set(a_blocks) <= hosted

    found = cache.match(a)
    assert (found.device_tokens, found.host_tokens, found.store_tokens) == (0, 8, 0)
    ops = tiers.take_ops()
    loads = [op for op in ops if op.kind == "load"]
    slot_of = {op.block: op.slot for op in saves}
    assert [(op.page_id, op.slot) for op in loads] == [
        (p, slot_of[b]) for p, b in zip(found.page_ids, a_blocks, strict=False)
    ]
    # a save the same lookup caused (evicting a device page for the loads) comes first
    kinds = [op.kind for op in ops]
    assert kinds.index("load") > max((i for i, k in enumerate(kinds) if k == "save"), default=-1)
    cache.free(found.page_ids)
    cache.check_integrity()
    assert cache.match(a).device_tokens == 8  # back on the device: the next lookup shares it


def test_a_block_computed_on_one_rank_is_read_from_the_store_by_another():
    store = DictStore()
    first, first_tiers = tiered_cache(num_pages=8, store=store)
    prompt = list(range(300, 313))  # 3 full pages + 1
    compute(first, prompt)
    write_through(first_tiers, store)
    blocks = block_hashes(prompt, PAGE)
    assert all(first_tiers.key(b) in store.values for b in blocks)
    written = [e for e in first.take_events() if isinstance(e, BlockStored) and e.tier == "store"]
    assert {h for e in written for h in e.block_hashes} == set(blocks)

    second, second_tiers = tiered_cache(num_pages=8, store=store)
    found = fetched_match(second, prompt)
    assert (found.device_tokens, found.host_tokens, found.store_tokens) == (0, 0, 12)
    fills = [op for op in second_tiers.take_ops() if op.kind == "fill"]
    assert [op.payload for op in fills] == [payload_of(b) for b in blocks]
    assert [op.page_id for op in fills] == found.page_ids
    second.free(found.page_ids)
    second.check_integrity()
    # what it read it does not write back
    compute(second, prompt)
    assert not [op for op in second_tiers.take_ops() if op.kind == "write"]


def test_a_corrupt_or_foreign_block_is_a_counted_miss_and_the_run_stops_there():
    store = DictStore()
    cache, tiers = tiered_cache(num_pages=8, store=store)
    prompt = list(range(400, 413))
    blocks = block_hashes(prompt, PAGE)
    parents = [None, *blocks[:-1]]
    for i, (block, parent) in enumerate(zip(blocks, parents, strict=False)):
        tokens = prompt[i * PAGE : (i + 1) * PAGE]
        key = tiers.key(block)
        store.values[key] = encode_block(
            SECRET, StoredBlock(key, parent, tokens), "m", LAYOUT, payload_of(block)
        )
    key = tiers.key(blocks[1])
    good = store.values[key]
    store.values[key] = good[:-40] + bytes([good[-40] ^ 1]) + good[-39:]  # one flipped bit of KV
    found = fetched_match(cache, prompt)
    assert found.store_tokens == PAGE and tiers.store_rejected == 1
    cache.free(found.page_ids)
    store.values[key] = encode_block(
        SECRET, StoredBlock(key, blocks[0], prompt[4:8]), "other-model", LAYOUT, payload_of(blocks[1])
    )
    found = fetched_match(cache, prompt)
    assert found.num_tokens == PAGE and tiers.store_rejected == 2  # block 0 now on the device
    cache.free(found.page_ids)
    cache.check_integrity()


def test_a_store_that_is_down_is_a_miss_counted_and_not_asked_again_for_a_while():
    store = DictStore()
    cache, tiers = tiered_cache(num_pages=8, store=store)
    store.down = True
    prompt = list(range(500, 509))
    found = fetched_match(cache, prompt)
    assert found.num_tokens == 0 and tiers.store_errors == 1
    cache.free(found.page_ids)
    assert cache.prefetch(list(range(600, 609))) is None  # backing off: not asked, nothing to wait for
    cache.match(list(range(600, 609)))
    assert tiers.store_errors == 1
    assert tiers.stats().store_errors == 1


def test_a_tier_priced_slower_than_computing_is_not_loaded_and_the_recompute_is_counted():
    store = DictStore()
    first, first_tiers = tiered_cache(num_pages=8, store=store)
    compute(first, list(range(700, 705)))  # the store holds the first block only
    write_through(first_tiers, store)
    prompt = list(range(700, 713))  # asks for 3 blocks: worth a round trip; 1 is not
    slow = TierPrices(store_bytes_per_s=1e12, prefill_tokens_per_s=100.0, store_latency_s=0.06)
    second, second_tiers = tiered_cache(num_pages=8, store=store, prices=slow)
    store.gets = 0
    found = fetched_match(second, prompt)
    assert found.num_tokens == 0 and store.gets == 0
    assert second_tiers.recomputed_tokens == 4 and second_tiers.store_errors == 0
    # a run not worth a round trip even if the store held all of it is not asked at all
    never = TierPrices(store_bytes_per_s=1.0, prefill_tokens_per_s=1e6)
    third, third_tiers = tiered_cache(num_pages=8, store=store, prices=never)
    assert third.prefetch(prompt) is None and not third_tiers._fetches


def test_the_evictions_a_host_load_causes_never_take_the_blocks_it_loads():
    """A host tier of 2 slots holding a 2-block prefix, and a full device: loading the prefix
    evicts 2 device pages to the host, which must not push out the 2 blocks being loaded."""
    cache, tiers = tiered_cache(num_pages=4, host_pages=2)
    a = list(range(800, 809))
    compute(cache, a)
    compute(cache, list(range(900, 916)))  # evicts a's 2 pages to the 2 host slots
    tiers.take_ops()
    assert sorted(tiers.host_blocks()) == sorted(block_hashes(a, PAGE))
    found = cache.match(a)
    assert found.host_tokens == 8  # both loaded; the 2 device pages evicted for them found no free slot
    ops = tiers.take_ops()
    assert [op.kind for op in ops].count("load") == 2
    assert not [op for op in ops if op.kind == "save"]
    cache.free(found.page_ids)
    cache.check_integrity()
