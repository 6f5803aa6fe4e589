"""Block hashes, the prefix cache and the KV events it emits.

A full page of token ids is named by a chained hash, so equal hashes mean equal prefixes::

    tokens   [t0 .. t63][t64 .. t127][t128 .. t150]
    hashes   h0=H(root,p0) h1=H(h0,p1)   (partial page: no hash)

A prompt's ``root`` is ``chain_root(cache_salt)``: ``None`` without a salt, else a hash of the
salt, so only requests with the same salt share blocks, in every tier and at the router.

``PrefixCache`` is the one object a scheduler asks for pages. It wraps the allocator and keeps
full, computed pages under their hash after their requests free them, so later requests with
the same prefix reuse them. Page states, as the cache sees them::

    free        in the allocator's free list
    referenced  refcount >= 1; cached (registered under a hash) or not
    evictable   refcount 0 and cached; parked in the allocator, LRU order here

Invariant: ``free + evictable + referenced == total``. Only requests hold references; the cache
holds none. A referenced non-cached page has exactly one owner (only cached pages are shared).
Every change to the set of cached hashes is reported as a ``KVEvent`` for the router.

With ``tiers`` (``engine/kv_tiers.py``) the cache has lower tiers: an evicted page's block goes
to the rank's host tier, every computed block to the shared store, and a lookup continues past
the device's run into them: each block found there gets a fresh device page, registered under
its hash at once (so the next lookup shares it), whose KV the rank copies in (the ``TierOp``s,
executed in order before the forward that reads them). With ``hit_pages`` the whole run, device
pages and loaded ones, is cut to where the state is restorable (a V4 block carries its boundary
state or not), so a device run whose own end is not restorable may go on to a lower block that
is.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tandem.engine.page_allocator import PageAccountingError, PageAllocator
from tandem.wire.block_chain import ChainBlock as ChainBlock
from tandem.wire.block_chain import block_hash as block_hash
from tandem.wire.block_chain import block_hashes as block_hashes
from tandem.wire.block_chain import chain_root as chain_root
from tandem.wire.block_chain import prompt_chain as prompt_chain
from tandem.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass
class LowerMatch:
    """What the lower tiers hold of a chain's leading run: per block, its tier (``order``:
    "device", "host" or "store"), with the host slot or the checked store payload."""

    host: list[tuple[ChainBlock, int]] = field(default_factory=list)
    store: list[tuple[ChainBlock, bytes]] = field(default_factory=list)
    order: list[str] = field(default_factory=list)


class PendingFetch(Protocol):
    """A store fetch a request waits on: ``settled`` once answered or past its deadline."""

    def settled(self) -> bool: ...


class LowerTiers(Protocol):
    """The tiers below the device (``engine/kv_tiers.py`` ``KVTiers``), as the cache calls them."""

    def evicted(self, page_id: int, block: int) -> None: ...
    def computed(self, page_id: int, chain: ChainBlock) -> None: ...
    def prefetch(self, chain: Sequence[ChainBlock], on_device: Sequence[bool]) -> PendingFetch | None: ...
    def lookup(self, chain: Sequence[ChainBlock], on_device: Sequence[bool]) -> LowerMatch: ...
    def still_in_host(self, block: int, slot: int) -> bool: ...
    def end_lookup(self) -> None: ...
    def loaded(self, kind: str, page_id: int, block: int, slot: int = -1, payload: bytes = b"") -> None: ...
    def take_events(self) -> list[KVEvent]: ...
    def clear_host(self) -> None: ...


@dataclass(frozen=True)
class PrefixMatch:
    """A lookup's pages (the caller's to free) and how many of its tokens each tier held."""

    page_ids: list[int] = field(default_factory=list)
    device_tokens: int = 0
    host_tokens: int = 0
    store_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.device_tokens + self.host_tokens + self.store_tokens


class PrefixCache:
    """Page allocation with prefix reuse, for one KV pool. With ``enabled=False`` it is a plain
    allocator: nothing is matched or cached and no events are emitted."""

    def __init__(
        self, allocator: PageAllocator, page_size: int, enabled: bool = True, tiers: LowerTiers | None = None
    ) -> None:
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
        self.tiers = tiers if enabled else None
        # the most leading pages of a matched device run a hit may use (a model whose state at a
        # boundary is restorable only where it kept what it needs: DeepSeek-V4's window slots)
        self.hit_pages: Callable[[list[int]], int] | None = None
        # whether a page just computed should hold a hash an older page holds (its state more
        # useful to hits: V4's page with a window slot over one without); only an older page
        # with at most one owner gives its hash up
        self.better_holder: Callable[[int, int], bool] | None = None
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

    def match_prefix(self, token_ids: Sequence[int], cache_salt: str | None = None) -> tuple[list[int], int]:
        """``match``'s pages and token count."""
        found = self.match(token_ids, cache_salt)
        return found.page_ids, found.num_tokens

    def match(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PrefixMatch:
        """Take a reference on the longest cached run of leading full pages, in any tier.

        Returns the page ids (now owned by the caller: ``free`` them) and the tokens each tier
        held. At least one token is always left to compute, so the caller has logits to sample
        from: at most ``(len(token_ids) - 1) // page_size`` pages match. Only pages cached under
        the same ``cache_salt`` match (``chain_root``). With ``hit_pages``, the run is cut to the
        pages it allows: a device run at once, one that goes on into the lower tiers after them.
        """
        self.num_queried_tokens += len(token_ids)
        if not self._enabled:
            return PrefixMatch()
        size = self._page_size
        num_blocks = (len(token_ids) - 1) // size
        page_ids: list[int] = []
        parent = chain_root(cache_salt)
        for index in range(num_blocks):
            block = block_hash(parent, token_ids[index * size : (index + 1) * size])
            page_id = self._hash_to_page.get(block)
            if page_id is None:
                break
            page_ids.append(page_id)
            parent = block
        lower = self.tiers is not None and len(page_ids) < num_blocks
        if self.hit_pages is not None and page_ids and not lower:
            cut = self.hit_pages(page_ids)
            if cut < len(page_ids):  # a hit that ends where the state is restorable, not past it
                page_ids, num_blocks = page_ids[:cut], cut
        self._take(page_ids)
        found = PrefixMatch(page_ids, device_tokens=len(page_ids) * size)
        if lower:  # the run goes on below; with ``hit_pages`` it is cut there, device pages too
            found = self._match_lower(token_ids, page_ids, parent, num_blocks)
        self.num_hit_tokens += found.num_tokens
        return found

    def prefetch(self, token_ids: Sequence[int], cache_salt: str | None = None) -> PendingFetch | None:
        """``None`` when ``match`` of ``token_ids`` may run now; else the fetch of its blocks
        from the store, under way off this thread: the request waits (ask again once it is
        ``settled``) while other requests step. Takes nothing."""
        if self.tiers is None or not self._enabled:
            return None
        size = self._page_size
        chain = prompt_chain(token_ids[: (len(token_ids) - 1) // size * size], size, cache_salt)
        if not chain:
            return None
        return self.tiers.prefetch(chain, [c.block in self._hash_to_page for c in chain])

    def _take(self, page_ids: Sequence[int]) -> None:
        for page_id in page_ids:
            self._evictable.pop(page_id, None)
        self._allocator.incref(page_ids)

    def _match_lower(
        self, token_ids: Sequence[int], page_ids: list[int], parent: int | None, num_blocks: int
    ) -> PrefixMatch:
        """Continue a device run into the host tier and the store (see the module docstring)."""
        tiers, size = self.tiers, self._page_size
        assert tiers is not None
        chain: list[ChainBlock] = []
        for index in range(len(page_ids), num_blocks):
            tokens = tuple(token_ids[index * size : (index + 1) * size])
            chain.append(ChainBlock(block_hash(parent, tokens), parent, tokens))
            parent = chain[-1].block
        lower = tiers.lookup(chain, [c.block in self._hash_to_page for c in chain])
        device_later = [
            self._hash_to_page[c.block]
            for c, kind in zip(chain, lower.order, strict=False)
            if kind == "device"
        ]
        self._take(device_later)  # referenced now: the allocation below cannot evict them
        need = len(lower.host) + len(lower.store)
        fresh = self.allocate(min(need, self.num_free_pages)) or []
        host = dict((b.block, slot) for b, slot in lower.host)
        store = dict((b.block, payload) for b, payload in lower.store)
        taken, later, used = list(page_ids), iter(device_later), 0
        held = ["device"] * len(page_ids)  # the tier of each page taken
        run: list[int] = []
        run_parent = chain[0].parent if chain else None
        for link, kind in zip(chain, lower.order, strict=False):
            if kind == "device":
                self._flush_stored(run, run_parent)
                taken.append(next(later))
                held.append("device")
                run_parent = link.block
                continue
            if used == len(fresh) or (
                kind == "host" and not tiers.still_in_host(link.block, host[link.block])
            ):
                break
            page_id = fresh[used]
            used += 1
            if kind == "host":
                tiers.loaded("host", page_id, link.block, slot=host[link.block])
            else:
                tiers.loaded("store", page_id, link.block, payload=store[link.block])
            self._page_hash[page_id] = link.block
            self._hash_to_page[link.block] = page_id
            if not run:
                run_parent = link.parent
            run.append(link.block)
            taken.append(page_id)
            held.append(kind)
        self._flush_stored(run, run_parent)
        tiers.end_lookup()
        self.free(fresh[used:])
        self.free(list(later))  # device pages past the point where the run broke
        if self.hit_pages is not None:
            # the loads recorded the pages' boundary state: a hit ends where it is restorable (the
            # pages past that stay cached, their loads done, for the hits that end there), which
            # may be past a device run whose own end is not
            cut = self.hit_pages(taken)
            self.free(taken[cut:])
            taken, held = taken[:cut], held[:cut]
        return PrefixMatch(taken, *(held.count(tier) * size for tier in ("device", "host", "store")))

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
                if self.tiers is not None:
                    self.tiers.evicted(page_id, page_hash)
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
        cache_salt: str | None = None,
    ) -> None:
        """Register each page of ``page_ids`` that is full and computed under its chained hash.

        ``num_cached_pages_hint`` says how many leading pages earlier calls already saw (for a
        request: its computed-token count before this step, divided by the page size), so a
        step costs only the pages that filled since. A too-small hint is merely slower. A page
        whose hash another page already holds stays uncached and is freed normally. The chain
        starts at ``chain_root(cache_salt)``: the request's salt, as its ``match`` was given.
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
        if start == 0:
            parent = chain_root(cache_salt)
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
            holder = self._hash_to_page.get(page_hash)
            if known is None and holder is None:
                self._hash_to_page[page_hash] = page_id
                if not run:
                    run_parent = parent
                run.append(page_hash)
            else:
                if known is None and holder is not None and self._takes_over(holder, page_id):
                    self._hash_to_page[page_hash] = page_id  # the same hash cached: no event
                self._flush_stored(run, run_parent)
            if known is None:
                self._page_hash[page_id] = page_hash
                if self.tiers is not None:
                    tokens = tuple(token_ids[index * size : (index + 1) * size])
                    self.tiers.computed(page_id, ChainBlock(page_hash, parent, tokens))
            parent = page_hash
        self._flush_stored(run, run_parent)

    def _takes_over(self, holder: int, page_id: int) -> bool:
        """Whether ``page_id`` takes over the hash ``holder`` holds (``better_holder``); the
        holder, uncached, is freed if no request holds it, else left to its one owner."""
        if self.better_holder is None or self._allocator.refcount(holder) > 1:
            return False
        if not self.better_holder(holder, page_id):
            return False
        if holder in self._evictable:
            del self._evictable[holder]
            del self._page_hash[holder]
            self._allocator.release([holder])
        return True

    def share(self, page_ids: Sequence[int]) -> None:
        """One more owner for each of these used pages (a forked request shares its parent's)."""
        self._allocator.incref(page_ids)

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
        if self.tiers is not None:
            self._events.extend(self.tiers.take_events())
            self.tiers.clear_host()
        self._events.append(AllBlocksCleared())

    def take_events(self) -> list[KVEvent]:
        """Events since the last call, oldest first (a lower tier's after the device's: the
        tiers are independent sets, so only the order within each matters)."""
        events, self._events = self._events, []
        if self.tiers is not None:
            events.extend(self.tiers.take_events())
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
