from __future__ import annotations

import random

import pytest

from tandem.engine.page_allocator import PageAllocator
from tandem.engine.prefix_cache import PrefixCache, block_hashes
from tandem.router.index import BlockIndex, IndexIntegrityError, TierMatch
from tandem.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier

PAGE = 4


def stored(*hashes: int, parent: int | None = None, tier: Tier = "device") -> BlockStored:
    return BlockStored(tuple(hashes), parent, PAGE, tier)


def moved_to_host(*hashes: int) -> list[KVEvent]:
    """What a rank sends when it evicts blocks from its device to its host pool."""
    return [BlockRemoved(tuple(hashes), "device"), stored(*hashes, tier="host")]


def test_match_walks_each_rank_to_its_first_missing_hash() -> None:
    index = BlockIndex()
    index.apply("p0-r0", stored(1, 2, 3))
    index.apply("p0-r1", stored(1, 2))
    index.apply("p0-r2", stored(1, 9))
    index.apply("p0-r3", stored(2, 3))  # the tail without its root never matches
    assert index.match([1, 2, 3, 4]) == {"p0-r0": 3, "p0-r1": 2, "p0-r2": 1}
    assert index.match([1, 2, 3]) == {"p0-r0": 3, "p0-r1": 2, "p0-r2": 1}
    assert index.match([5, 2, 3]) == {}
    assert index.match([]) == {}
    assert index.block_counts() == {"p0-r0": 3, "p0-r1": 2, "p0-r2": 2, "p0-r3": 2}
    assert index.num_distinct_blocks == 4
    index.check_integrity()


def test_removal_ends_a_match_and_clearing_forgets_a_rank() -> None:
    index = BlockIndex()
    index.apply_all("p0-r0", [stored(1, 2, 3), stored(4, parent=3)])
    index.apply("p0-r1", stored(1, 2, 3, 4))
    index.apply("p0-r0", BlockRemoved((2, 77)))  # 77 was never stored: ignored
    assert index.match([1, 2, 3, 4]) == {"p0-r0": 1, "p0-r1": 4}
    index.apply("p0-r5", BlockRemoved((1,)))  # a rank the index never heard of
    index.apply("p0-r1", AllBlocksCleared())
    assert index.match([1, 2, 3, 4]) == {"p0-r0": 1}
    assert index.num_blocks("p0-r1") == 0 and index.ranks == ["p0-r0"]
    index.remove_rank("p0-r0")
    assert index.match([1]) == {} and index.num_distinct_blocks == 0
    index.check_integrity()


def test_a_snapshot_replaces_what_the_index_knew() -> None:
    # A re-subscription sends AllBlocksCleared then every cached hash, parentless.
    index = BlockIndex()
    index.apply("p0-r0", stored(1, 2, 3))
    index.apply_all("p0-r0", [AllBlocksCleared(), stored(1, 5)])
    assert index.match([1, 2]) == {"p0-r0": 1}
    assert index.match([1, 5]) == {"p0-r0": 2}
    index.check_integrity()


def test_match_equals_the_ranks_own_prefix_match_under_eviction() -> None:
    """Fed a real PrefixCache's events, the index predicts exactly what match_prefix finds."""
    rng = random.Random(7)
    cache = PrefixCache(PageAllocator(24), PAGE)
    index = BlockIndex()
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 17))] for _ in range(5)]
    for _ in range(200):
        tokens = rng.choice(prefixes) + [rng.randrange(50) for _ in range(rng.randrange(0, 10))]
        cap = (len(tokens) - 1) // PAGE
        predicted = index.match(block_hashes(tokens, PAGE)[:cap]).get("p0-r0", 0) * PAGE
        pages, cached_tokens = cache.match_prefix(tokens)
        assert predicted == cached_tokens
        fresh = cache.allocate(-(-len(tokens) // PAGE) - len(pages))
        assert fresh is not None
        pages += fresh
        cache.cache_full_pages(tokens, pages, len(tokens))
        cache.free(pages)
        index.apply_all("p0-r0", cache.take_events())
        assert index.num_blocks("p0-r0") == cache.num_cached_pages
    index.check_integrity()
    cache.check_integrity()


@pytest.mark.parametrize("tier", ["device", "host"])
def test_check_integrity_notices_maps_that_disagree(tier: Tier) -> None:
    index = BlockIndex()
    index.apply("p0-r0", stored(1, 2, tier=tier))
    index.check_integrity()
    index._tier(tier).hashes_by_rank["p0-r0"].discard(2)  # corrupt one direction only
    with pytest.raises(IndexIntegrityError, match=tier):
        index.check_integrity()


def test_apply_rejects_what_is_not_an_event() -> None:
    with pytest.raises(TypeError):
        BlockIndex().apply("p0-r0", "BlockStored")  # type: ignore[arg-type]


def test_a_rank_keeps_the_blocks_it_moves_from_device_to_host() -> None:
    index = BlockIndex()
    index.apply("p0-r0", stored(1, 2, 3, 4))
    index.apply_all("p0-r0", moved_to_host(3, 4))
    assert index.match([1, 2, 3, 4]) == {"p0-r0": 4}
    assert index.match_tiers([1, 2, 3, 4]).get("p0-r0") == TierMatch(device=2, host=2)
    assert (index.num_blocks("p0-r0"), index.num_blocks("p0-r0", "host")) == (2, 2)
    # loaded back to the device while a host copy stays: the device is the nearer tier
    index.apply("p0-r0", stored(3, tier="device"))
    assert index.match_tiers([1, 2, 3, 4]).get("p0-r0") == TierMatch(device=3, host=1)
    index.apply("p0-r0", BlockRemoved((4,), "host"))  # the host pool evicts it: gone
    assert index.match_tiers([1, 2, 3, 4]).get("p0-r0") == TierMatch(device=3)
    index.apply("p0-r0", BlockRemoved((2,), "host"))  # not on host: the device copy stays
    assert index.match([1, 2, 3]) == {"p0-r0": 3}
    index.check_integrity()


def test_store_blocks_match_for_every_rank_and_outlive_them() -> None:
    index = BlockIndex()
    index.apply("p0-r0", stored(1, 2, 3, tier="store"))  # written by one rank, read by all
    index.apply("p0-r1", stored(1))
    index.apply_all("p0-r2", [stored(5), *moved_to_host(5)])  # holds block 4's successor only
    index.apply("p0-r3", stored(9))
    found = index.match_tiers([1, 2, 3, 4])
    assert found.store_blocks == 3
    assert found.get("p0-r1") == TierMatch(device=1, store=2)
    assert found.get("p0-r7") == TierMatch(store=3)  # a rank the index never heard of
    assert found.get("p0-r0") == TierMatch(store=3)  # writing to the store is not holding it
    # a rank's own block past the store's run extends its run, the store's blocks before it count
    assert index.match_tiers([1, 2, 3, 5]).get("p0-r2") == TierMatch(host=1, store=3)
    assert index.match([1, 2, 3, 5]) == {"p0-r1": 3, "p0-r2": 4}
    # the store's run ends at its first missing block, even if a rank has later ones
    assert index.match_tiers([1, 7, 3]).get("p0-r9") == TierMatch(store=1)
    index.apply("p0-r0", AllBlocksCleared())
    index.remove_rank("p0-r1")
    assert index.match_tiers([1, 2, 3]).get("p0-r1") == TierMatch(store=3)
    assert index.num_store_blocks == 3
    index.apply("p0-r3", BlockRemoved((2,), "store"))  # any rank's removal empties the store's slot
    assert index.match_tiers([1, 2, 3]).store_blocks == 1
    index.check_integrity()


def test_each_tiers_removal_touches_only_that_tier() -> None:
    index = BlockIndex()
    index.apply_all("p0-r0", [stored(1, 2), stored(1, 2, tier="host"), stored(1, 2, tier="store")])
    index.apply("p0-r0", BlockRemoved((1,), "device"))
    assert index.match_tiers([1, 2]).get("p0-r0") == TierMatch(device=1, host=1)
    index.apply("p0-r0", BlockRemoved((1,), "host"))
    assert index.match_tiers([1, 2]).get("p0-r0") == TierMatch(device=1, store=1)
    index.apply("p0-r0", BlockRemoved((1,), "store"))
    assert index.match_tiers([1, 2]).get("p0-r0") == TierMatch()
    index.check_integrity()


def test_a_snapshot_of_tiers_replaces_the_ranks_tiers_but_not_the_store() -> None:
    index = BlockIndex()
    index.apply_all("p0-r0", [stored(1, 2), stored(3, tier="host"), stored(8, tier="store")])
    index.apply_all("p0-r0", [AllBlocksCleared(), stored(1), stored(2, tier="host")])
    assert index.match_tiers([1, 2, 3]).get("p0-r0") == TierMatch(device=1, host=1)
    assert index.match_tiers([8]).get("p0-r5") == TierMatch(store=1)
    assert index.ranks == ["p0-r0"]
    index.check_integrity()


def test_tiered_match_equals_a_brute_force_walk() -> None:
    """Random events over four ranks and a store: each rank's run and split is what walking
    the prompt block by block through its tiers finds."""
    rng = random.Random(3)
    ranks = [f"p0-r{i}" for i in range(4)]
    index = BlockIndex()
    held: dict[tuple[str, str], set[int]] = {(r, t): set() for r in ranks for t in ("device", "host")}
    store: set[int] = set()
    tiers: list[Tier] = ["device", "host", "store"]
    for _ in range(400):
        rank, tier = rng.choice(ranks), rng.choice(tiers)
        blocks = tuple(rng.sample(range(12), rng.randrange(1, 4)))
        if rng.random() < 0.6:
            index.apply(rank, stored(*blocks, tier=tier))
            (store if tier == "store" else held[rank, tier]).update(blocks)
        else:
            index.apply(rank, BlockRemoved(blocks, tier))
            (store if tier == "store" else held[rank, tier]).difference_update(blocks)
        prompt = list(range(rng.randrange(0, 12)))
        found = index.match_tiers(prompt)
        for r in [*ranks, "p0-r9"]:
            counts = {"device": 0, "host": 0, "store": 0}
            for block in prompt:
                where = next(
                    (t for t in tiers if block in (store if t == "store" else held.get((r, t), set()))), None
                )
                if where is None:
                    break
                counts[where] += 1
            assert found.get(r) == TierMatch(**counts), (r, prompt)
    index.check_integrity()
