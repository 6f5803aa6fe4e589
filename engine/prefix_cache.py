"""Block hashes, the prefix cache and the KV events it emits.

A full page of token ids is named by a chained hash, so equal hashes mean equal prefixes::

    tokens   [t0 .. t63][t64 .. t127][t128 .. t150]
    hashes   h0=H(None,p0) h1=H(h0,p1)   (partial page: no hash)

``PrefixCache`` is the one object a scheduler asks for pages. It wraps the allocator and keeps
full, computed pages under their hash after their requests free them, so later requests with
the same prefix reuse them. Page states, as the cache sees them::

    free        in the allocator's free list
    referenced  refcount >= 1; cached (registered under a hash) or not
    evictable   refcount 0 and cached; parked in the allocator, LRU order here

Invariant: ``free + evictable + referenced == total``. Only requests hold references; the cache
holds none. A referenced non-cached page has exactly one owner (only cached pages are shared).
Every change to the set of cached hashes is reported as a ``KVEvent`` for the router.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from tandem.engine.page_allocator import PageAccountingError, PageAllocator
from tandem.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent

_ROOT_MARKER = b"\x00"
_CHILD_MARKER = b"\x01"


def block_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """64-bit hash of one page's tokens chained to its parent's; the same in every process."""
    hasher = hashlib.blake2b(digest_size=8)
    if parent_hash is None:
        hasher.update(_ROOT_MARKER)
    else:
        hasher.update(_CHILD_MARKER + parent_hash.to_bytes(8, "little"))
    packed = array("q", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    hasher.update(packed.tobytes())
    return int.from_bytes(hasher.digest(), "little")


def block_hashes(token_ids: Sequence[int], page_size: int) -> list[int]:
    """Chained hashes of the full pages of ``token_ids`` (a trailing partial page has none)."""
    hashes: list[int] = []
    parent: int | None = None
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        parent = block_hash(parent, token_ids[start : start + page_size])
        hashes.append(parent)
    return hashes


class PrefixCache:
    """Page allocation with prefix reuse, for one KV pool. With ``enabled=False`` it is a plain
    allocator: nothing is matched or cached and no events are emitted."""

    def __init__(self, allocator: PageAllocator, page_size: int, enabled: bool = True) -> None:
        if not isinstance(page_size, int) or page_size <= 0:
            raise ValueError(f"page_size must be a positive integer, got {page_size!r}")
        self._allocator = allocator
        self._page_size = page_size
        self._enabled = enabled
        # Hash of every full, computed page still in use or evictable, cached or not (a page
        # whose hash another page already holds stays uncached but keeps its hash here, so the
        # next page's chained hash is found without rehashing the prefix).
        self._page_hash: dict[int, int] = {}
        self._hash_to_page: dict[int, int] = {}
        self._evictable: OrderedDict[int, None] = OrderedDict()  # first = evicted first
        self._events: list[KVEvent] = []
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0

    @property
    def page_size(self) -> int:
        return self._page_size

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def num_total_pages(self) -> int:
        return self._allocator.num_pages

    @property
    def num_free_pages(self) -> int:
        """Pages ``allocate`` can hand out now: free plus evictable."""
        return self._allocator.num_free + len(self._evictable)

    @property
    def num_cached_pages(self) -> int:
        return len(self._hash_to_page)

    def cached_block_hashes(self) -> list[int]:
        """Every block hash cached now (a subscriber's starting snapshot before the events)."""
        return list(self._hash_to_page)

    @property
    def num_evictable_pages(self) -> int:
        return len(self._evictable)

    def refcount(self, page_id: int) -> int:
        """Number of requests holding ``page_id``."""
        return self._allocator.refcount(page_id)

    def is_cached(self, page_id: int) -> bool:
        return self.cached_hash(page_id) is not None

    def cached_hash(self, page_id: int) -> int | None:
        """The hash ``page_id`` is registered under, or ``None`` when it is not cached."""
        page_hash = self._page_hash.get(page_id)
        if page_hash is not None and self._hash_to_page.get(page_hash) == page_id:
            return page_hash
        return None

    def match_prefix(self, token_ids: Sequence[int]) -> tuple[list[int], int]:
        """Take a reference on the longest cached run of leading full pages.

        Returns the page ids (now owned by the caller: ``free`` them) and the number of tokens
        they hold. At least one token is always left to compute, so the caller has logits to
        sample from: at most ``(len(token_ids) - 1) // page_size`` pages match.
        """
        self.num_queried_tokens += len(token_ids)
        if not self._enabled:
            return [], 0
        size = self._page_size
        page_ids: list[int] = []
        parent: int | None = None
        for index in range((len(token_ids) - 1) // size):
            parent = block_hash(parent, token_ids[index * size : (index + 1) * size])
            page_id = self._hash_to_page.get(parent)
            if page_id is None:
                break
            page_ids.append(page_id)
        for page_id in page_ids:
            self._evictable.pop(page_id, None)
        self._allocator.incref(page_ids)
        num_tokens = len(page_ids) * size
        self.num_hit_tokens += num_tokens
        return page_ids, num_tokens

    def undo_match(self, page_ids: Sequence[int], num_queried_tokens: int) -> None:
        """Give back a ``match_prefix`` result whose request could not be admitted after all,
        taking the lookup back out of the hit counters."""
        self.num_queried_tokens -= num_queried_tokens
        self.num_hit_tokens -= len(page_ids) * self._page_size
        self.free(page_ids)

    def allocate(self, n: int) -> list[int] | None:
        """``n`` fresh pages (refcount 1): free pages first, then the least recently freed
        evictable ones. ``None``, with nothing evicted, when even that is not enough."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        shortfall = n - self._allocator.num_free
        if shortfall > len(self._evictable):
            return None
        if shortfall > 0:
            evicted = [self._evictable.popitem(last=False)[0] for _ in range(shortfall)]
            removed = []
            for page_id in evicted:
                page_hash = self._page_hash.pop(page_id)
                del self._hash_to_page[page_hash]
                removed.append(page_hash)
            self._allocator.release(evicted)
            self._events.append(BlockRemoved(tuple(removed)))
        page_ids = self._allocator.allocate(n)
        if page_ids is None:
            raise PageAccountingError(f"{n} pages should be free after eviction, found fewer")
        return page_ids

    def cache_full_pages(
        self,
        token_ids: Sequence[int],
        page_ids: Sequence[int],
        num_computed_tokens: int,
        num_cached_pages_hint: int = 0,
    ) -> None:
        """Register each page of ``page_ids`` that is full and computed under its chained hash.

        ``num_cached_pages_hint`` says how many leading pages earlier calls already saw (for a
        request: its computed-token count before this step, divided by the page size), so a
        step costs only the pages that filled since. A too-small hint is merely slower. A page
        whose hash another page already holds stays uncached and is freed normally.
        """
        if not self._enabled:
            return
        size = self._page_size
        if num_computed_tokens > len(token_ids):
            raise ValueError(f"num_computed_tokens {num_computed_tokens} > {len(token_ids)} tokens")
        num_full = min(num_computed_tokens // size, len(page_ids))
        start = max(0, min(num_cached_pages_hint, num_full))
        parent = self._page_hash.get(page_ids[start - 1]) if start > 0 else None
        if start > 0 and parent is None:  # the hint was wrong: walk the chain from the root
            start = 0
        run: list[int] = []
        run_parent = parent
        for index in range(start, num_full):
            page_hash = block_hash(parent, token_ids[index * size : (index + 1) * size])
            page_id = page_ids[index]
            known = self._page_hash.get(page_id)
            if known is not None and known != page_hash:
                raise PageAccountingError(
                    f"page {page_id} holds hash {known:#x} but its tokens hash to {page_hash:#x}"
                )
            if known is None and page_hash not in self._hash_to_page:
                self._hash_to_page[page_hash] = page_id
                if not run:
                    run_parent = parent
                run.append(page_hash)
            else:
                self._flush_stored(run, run_parent)
            if known is None:
                self._page_hash[page_id] = page_hash
            parent = page_hash
        self._flush_stored(run, run_parent)

    def free(self, page_ids: Sequence[int]) -> None:
        """Drop one reference from each page. Pages left unreferenced become evictable if cached
        (later pages of ``page_ids`` first, so a prefix outlives its tails), else free."""
        dropped = self._allocator.decref(page_ids, release=False)
        to_release = []
        for page_id in reversed(dropped):
            if self.cached_hash(page_id) is not None:
                self._evictable[page_id] = None
            else:
                self._page_hash.pop(page_id, None)
                to_release.append(page_id)
        self._allocator.release(to_release)

    def reset(self) -> None:
        """Forget every cached hash: evictable pages become free, referenced ones uncached."""
        evictable = list(self._evictable)
        for page_id in evictable:
            del self._page_hash[page_id]
        self._evictable.clear()
        self._hash_to_page.clear()
        self._allocator.release(evictable)
        self._events.append(AllBlocksCleared())

    def take_events(self) -> list[KVEvent]:
        """Events since the last call, oldest first."""
        events, self._events = self._events, []
        return events

    def check_integrity(self) -> None:
        """Raise ``PageAccountingError`` unless the page states and hash maps agree."""
        self._allocator.check_integrity(parked=self._evictable.keys())
        for page_hash, page_id in self._hash_to_page.items():
            if self._page_hash.get(page_id) != page_hash:
                raise PageAccountingError(f"hash {page_hash:#x} maps to page {page_id}, which holds another")
        for page_id in self._evictable:
            if self.cached_hash(page_id) is None:
                raise PageAccountingError(f"evictable page {page_id} is not cached")
        for page_id in self._page_hash:
            if page_id not in self._evictable and self._allocator.refcount(page_id) == 0:
                raise PageAccountingError(f"page {page_id} has a hash but is unreferenced and not evictable")
        if not self._enabled and (self._page_hash or self._evictable):
            raise PageAccountingError("prefix caching is disabled but pages are cached")

    def _flush_stored(self, run: list[int], parent: int | None) -> None:
        if run:
            self._events.append(BlockStored(tuple(run), parent, self._page_size))
            run.clear()
