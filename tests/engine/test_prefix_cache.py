from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.engine.page_allocator import PageAccountingError, PageAllocator
from tandem.engine.prefix_cache import PrefixCache, block_hash, block_hashes
from tandem.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

PAGE = 4


def make_cache(num_pages: int = 8, enabled: bool = True) -> PrefixCache:
    return PrefixCache(PageAllocator(num_pages), PAGE, enabled=enabled)


def run_request(cache: PrefixCache, tokens: list[int]) -> list[int]:
    """Match, allocate the rest, compute everything and cache it, as a scheduler would."""
    pages, _ = cache.match_prefix(tokens)
    fresh = cache.allocate(-(-len(tokens) // PAGE) - len(pages))
    assert fresh is not None
    pages += fresh
    cache.cache_full_pages(tokens, pages, len(tokens))
    return pages


def test_block_hash_is_chained_and_stable_across_processes() -> None:
    tokens = list(range(10, 20))
    hashes = block_hashes(tokens, PAGE)
    h0 = block_hash(None, tokens[0:4])
    assert hashes == [h0, block_hash(h0, tokens[4:8])]  # the partial page has no hash
    assert block_hash(0, tokens[0:4]) != h0  # the root differs from a parent of 0
    assert block_hash(h0, tokens[0:4]) != h0
    assert 0 <= h0 < 2**64
    code = "from engine.prefix_cache import block_hashes; print(block_hashes(list(range(10, 20)), 4))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(hashes)


def test_match_shares_pages_and_leaves_one_token_to_compute() -> None:
    cache = make_cache()
    tokens = list(range(8))
    pages = run_request(cache, tokens)
    hashes = block_hashes(tokens, PAGE)
    assert cache.take_events() == [BlockStored(tuple(hashes), None, PAGE)]

    # The same 8 tokens: matching both pages would leave nothing to compute.
    shared, num_cached = cache.match_prefix(tokens)
    assert (shared, num_cached) == (pages[:1], 4)
    longer, num_cached = cache.match_prefix([*tokens, 99])
    assert (longer, num_cached) == (pages, 8)
    assert cache.refcount(pages[0]) == 3 and cache.refcount(pages[1]) == 2
    assert cache.match_prefix([0, 1, 2, 7, 4, 5, 6, 7, 8]) == ([], 0)
    assert cache.match_prefix([]) == ([], 0)
    assert cache.num_hit_tokens == 12 and cache.num_queried_tokens == 8 + 8 + 9 + 9
    cache.check_integrity()

    cache.undo_match(longer, 9)
    assert cache.num_hit_tokens == 4 and cache.num_queried_tokens == 25
    for owned in (shared, pages):
        cache.free(owned)
    assert cache.num_free_pages == cache.num_total_pages == 8
    assert cache.num_evictable_pages == 2
    cache.check_integrity()


def test_incremental_caching_emits_chained_events() -> None:
    cache = make_cache()
    tokens = list(range(100, 114))  # 3 full pages + 2
    pages = cache.allocate(4)
    assert pages is not None
    hashes = block_hashes(tokens, PAGE)
    cache.cache_full_pages(tokens, pages, 3)
    assert cache.take_events() == []  # no page is full and computed yet
    cache.cache_full_pages(tokens, pages, 4)
    cache.cache_full_pages(tokens, pages, 13, num_cached_pages_hint=1)
    assert cache.take_events() == [
        BlockStored((hashes[0],), None, PAGE),
        BlockStored((hashes[1], hashes[2]), hashes[0], PAGE),
    ]
    cache.cache_full_pages(tokens, pages, 13)  # hint 0: slower, same result, no new event
    cache.cache_full_pages(tokens, pages, 13, num_cached_pages_hint=3)
    assert cache.take_events() == []
    assert [cache.cached_hash(p) for p in pages] == [*hashes, None]
    cache.check_integrity()


def test_duplicate_page_stays_uncached_and_is_freed() -> None:
    cache = make_cache()
    tokens = list(range(9))
    first = cache.allocate(3)
    second = cache.allocate(3)  # computed concurrently, before the first was cached
    assert first is not None and second is not None
    cache.cache_full_pages(tokens, first, 9)
    cache.take_events()
    cache.cache_full_pages(tokens, second, 9)
    assert cache.take_events() == []
    assert not any(cache.is_cached(p) for p in second)
    cache.free(second)
    assert cache.num_evictable_pages == 0 and cache.num_free_pages == 5
    cache.check_integrity()
    cache.free(first)
    assert cache.num_evictable_pages == 2
    cache.check_integrity()


def test_eviction_is_lru_and_emits_removed_events() -> None:
    cache = make_cache(num_pages=6)
    a_tokens, b_tokens = list(range(8)), list(range(50, 58))
    a_pages = run_request(cache, a_tokens)
    b_pages = run_request(cache, b_tokens)
    a_hashes, b_hashes = block_hashes(a_tokens, PAGE), block_hashes(b_tokens, PAGE)
    cache.take_events()
    cache.free(a_pages)  # a's tail, then a's head, then b's tail, then b's head
    cache.free(b_pages)
    assert cache.num_free_pages == 6 and cache.num_evictable_pages == 4

    assert cache.allocate(7) is None
    assert cache.take_events() == [] and cache.num_evictable_pages == 4  # nothing evicted

    # Matching a page takes it out of the evictable set, so it is not evicted.
    matched, _ = cache.match_prefix([*a_tokens[:4], 0])
    assert matched == a_pages[:1]
    fresh = cache.allocate(4)
    assert fresh is not None and set(fresh) >= {a_pages[1], b_pages[1]}
    assert cache.take_events() == [BlockRemoved((a_hashes[1], b_hashes[1]))]
    fresh2 = cache.allocate(1)
    assert fresh2 == [b_pages[0]]
    assert cache.take_events() == [BlockRemoved((b_hashes[0],))]
    assert cache.match_prefix([*b_tokens, 1]) == ([], 0)
    cache.check_integrity()
    for owned in (matched, fresh, fresh2):
        cache.free(owned)
    assert cache.num_free_pages == 6
    cache.check_integrity()


def test_reset_clears_hashes() -> None:
    cache = make_cache()
    held = run_request(cache, list(range(8)))
    released = run_request(cache, list(range(30, 38)))
    cache.free(released)
    cache.take_events()
    cache.reset()
    assert cache.take_events() == [AllBlocksCleared()]
    assert cache.num_cached_pages == 0 and cache.num_evictable_pages == 0
    assert cache.match_prefix(list(range(9))) == ([], 0)
    cache.check_integrity()
    cache.free(held)
    assert cache.num_free_pages == 8 and cache.num_evictable_pages == 0
    cache.check_integrity()


def test_disabled_cache_is_a_plain_allocator() -> None:
    cache = make_cache(enabled=False)
    tokens = list(range(12))
    pages = run_request(cache, tokens)
    assert cache.match_prefix([*tokens, 1]) == ([], 0)
    assert cache.take_events() == [] and cache.num_cached_pages == 0
    cache.free(pages)
    assert cache.num_evictable_pages == 0 and cache.num_free_pages == 8
    cache.check_integrity()


def test_check_integrity_finds_corruption() -> None:
    cache = make_cache()
    pages = run_request(cache, list(range(8)))
    cache._allocator.decref(pages[:1], release=False)  # dropped behind the cache's back
    with pytest.raises(PageAccountingError, match="leaked"):
        cache.check_integrity()

    cache = make_cache()
    pages = run_request(cache, list(range(8)))
    cache._hash_to_page[12345] = pages[0]
    with pytest.raises(PageAccountingError, match="maps to page"):
        cache.check_integrity()

    cache = make_cache()
    pages = cache.allocate(2)
    assert pages is not None
    cache.cache_full_pages(list(range(8)), pages, 8)
    with pytest.raises(PageAccountingError, match="tokens hash to"):
        cache.cache_full_pages(list(range(1, 9)), pages, 8)


def test_hit_pages_cuts_a_run_to_a_restorable_boundary_and_takes_no_page_past_it() -> None:
    """With ``hit_pages`` (a model that can restore its state only at some boundaries), a match
    ends at the boundary it allows: the pages past it get no reference and stay cached."""
    cache = make_cache()
    tokens = list(range(13))
    pages = run_request(cache, tokens)
    cache.free(pages)
    seen: list[list[int]] = []

    def only_the_first(run: list[int]) -> int:
        seen.append(list(run))
        return 1

    cache.hit_pages = only_the_first
    hit, num_cached = cache.match_prefix([*tokens[:12], 99])
    assert (hit, num_cached) == (pages[:1], 4) and seen == [pages[:3]]
    assert [cache.refcount(p) for p in pages[:3]] == [1, 0, 0]
    assert all(cache.is_cached(p) for p in pages[:3])
    assert cache.num_hit_tokens == 4
    cache.free(hit)
    cache.check_integrity()


def test_a_better_holder_takes_over_a_hash_from_an_unshared_page_without_an_event() -> None:
    """A page computed again (a hit cut short before it) takes over its tokens' hash when
    ``better_holder`` says so: the older page, held by no request, goes back to the free list;
    the cached hashes (and the router's view) do not change."""
    cache = make_cache()
    tokens = list(range(9))
    old = run_request(cache, tokens)
    cache.free(old)  # its two full pages cached, evictable
    cache.take_events()
    fresh = cache.allocate(3)
    assert fresh is not None and not set(fresh) & set(old)
    cache.better_holder = lambda holder, page: page == fresh[1]
    cache.cache_full_pages(tokens, fresh, len(tokens))
    assert cache.take_events() == []
    assert cache.cached_hash(fresh[1]) is not None and cache.cached_hash(old[1]) is None
    assert cache.cached_hash(old[0]) is not None and cache.cached_hash(fresh[0]) is None
    assert cache.num_evictable_pages == 1  # old[1] went back to the free list
    cache.check_integrity()
    hit, _ = cache.match_prefix([*tokens, 99])
    assert hit == [old[0], fresh[1]]
    cache.free(fresh)
    cache.free(hit)
    cache.check_integrity()
    assert cache.num_free_pages == cache.num_total_pages


def test_a_page_two_requests_hold_keeps_its_hash() -> None:
    cache = make_cache()
    tokens = list(range(9))
    old = run_request(cache, tokens)
    shared, _ = cache.match_prefix([*tokens, 99])  # a second owner of old's two full pages
    fresh = cache.allocate(3)
    assert fresh is not None
    cache.better_holder = lambda holder, page: True
    cache.cache_full_pages(tokens, fresh, len(tokens))
    assert cache.cached_hash(old[1]) is not None and cache.cached_hash(fresh[1]) is None
    for owned in (old, shared, fresh):
        cache.free(owned)
    cache.check_integrity()
