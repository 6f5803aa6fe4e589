from __future__ import annotations

import random

import pytest

from tandem.engine.page_allocator import PageAllocator
from tandem.engine.prefix_cache import PrefixCache, block_hashes
from tandem.router.index import BlockIndex, IndexIntegrityError
from tandem.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

PAGE = 4


def stored(*hashes: int, parent: int | None = None) -> BlockStored:
    return BlockStored(tuple(hashes), parent, PAGE)


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


def test_check_integrity_notices_maps_that_disagree() -> None:
    index = BlockIndex()
    index.apply("p0-r0", stored(1, 2))
    index._hashes_by_rank["p0-r0"].discard(2)  # corrupt one direction only
    with pytest.raises(IndexIntegrityError):
        index.check_integrity()


def test_apply_rejects_what_is_not_an_event() -> None:
    with pytest.raises(TypeError):
        BlockIndex().apply("p0-r0", "BlockStored")  # type: ignore[arg-type]
