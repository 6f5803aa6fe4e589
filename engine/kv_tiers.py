"""The KV tiers below a rank's device pages: a host-memory pool of its own and the shared store.

::

    device pages ──evicted──▶ host slots (LRU by block) ── the rank's own
         │  ▲                      │
         │  └──── load ◀───────────┘   (if loading is priced faster than computing again)
         │  ▲
         │  └──── fill ◀── shared store (every rank, every node; checked blocks only)
         └─ computed ──write (async)──▶ shared store

``KVTiers`` decides, torch-free, and records what must move as ``TierOp``s, in the order the
decisions were made; the rank executes them in that order (``engine/tier_copier.py``): the saves
and loads a ``schedule`` recorded before the forward that reads those pages, the writes an
``update`` recorded after the forward that computed them. Executing in order is what makes a
page evicted (saved) and reused (loaded) in the same step safe.

Policies. Host: inclusive (a block loaded back stays in its slot until LRU evicts it); a block
enters when the device evicts it. Store: write-through, each block once, when its page is first
full and computed (so a prefix is readable by every rank as soon as one computed it), from a
background thread; a block this rank read from the store is not written back. A decode rank
writes a finished request's pages (prompt and output) the same way. The store may fail at any
call: a failure is a miss (the tokens are computed), counted, and the store is not asked again
for ``store_retry_s``.

The loop thread never calls the store (its threads: ``engine/kv_store_io.py``). Reads go through a
thread of their own (``StoreReader``, which answers the fetches queued together in one ``exists``
and one ``get_many``)::

    scheduler: prefetch(chain) -> False ...... a fetch is queued; the request waits, others step
    reader:    exists, price, get_many, decode_block ... the checked payloads, or why not
    scheduler: prefetch(chain) -> True ....... answered (or overdue: a miss); the request is admitted
               lookup(chain) ................. the fetched payloads -> fill ops, as for the host tier

A fetch not answered within its price (recomputing the blocks it asks for, ``TierPrices``, plus
``answer_slack_s``) or ``store_timeout_s``, whichever is shorter, is a miss, counted, and the store
is backed off.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol

from tandem.engine.kv_block_codec import (
    BlockLayout,
    StoredBlock,
    encode_block,
    store_key,
)
from tandem.engine.kv_store_io import ReadChecks, StoreFetch, StoreReader, StoreWriter
from tandem.engine.prefix_cache import ChainBlock, LowerMatch
from tandem.kvtransfer.kv_store import KVStore
from tandem.wire.kv_events import BlockRemoved, BlockStored, KVEvent
from tandem.wire.messages import TierStats

log = logging.getLogger(__name__)

OpKind = Literal["save", "load", "fill", "write"]


@dataclass(frozen=True)
class TierOp:
    """One copy: ``save`` device page -> host ``slot``; ``load`` host ``slot`` -> device page;
    ``fill`` a checked store ``payload`` -> device page; ``write`` device page -> the store, as
    ``block`` (child of ``parent``, holding ``tokens``). ``window_slot``: the device slot of
    the page's boundary state (DeepSeek-V4's window KV and overlap, kept apart from its pages),
    read by a save or write, written by a load or fill; -1, none (the block goes without it)."""

    kind: OpKind
    page_id: int
    slot: int = -1
    block: int = 0
    parent: int | None = None
    tokens: tuple[int, ...] = ()
    payload: bytes = b""
    window_slot: int = -1


class BoundarySlots(Protocol):
    """Where a model keeps a page's boundary state apart from its pages (what a hit ending at
    the page restores beyond its entries: DeepSeek-V4's window slots, ``V4Runner``)."""

    def slot_of(self, page_id: int) -> int | None:
        """The slot holding ``page_id``'s boundary state, ``None`` when it has none."""
        ...

    def take(self, page_id: int, boundary: bool) -> int | None:
        """``page_id`` is being loaded whole (its entries, and its boundary state if
        ``boundary``): the slot to copy that into (``None``: none; the page goes without)."""
        ...


def _slot_of(boundary: BoundarySlots | None, page_id: int) -> int:
    """The slot of ``page_id``'s boundary state, -1 when it has none (or the model keeps none)."""
    slot = boundary.slot_of(page_id) if boundary is not None else None
    return -1 if slot is None else slot


class HostTier:
    """Block hash -> host slot, LRU. Only bookkeeping: the slots' bytes live with the copier."""

    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"host_cache_pages must be positive, got {num_slots}")
        self.num_slots = num_slots
        self._slot_of: OrderedDict[int, int] = OrderedDict()  # first = evicted first
        self._free = list(range(num_slots - 1, -1, -1))
        # blocks a lookup is loading: the evictions its own allocation causes must not take them
        self.pinned: set[int] = set()

    def __len__(self) -> int:
        return len(self._slot_of)

    def __contains__(self, block: int) -> bool:
        return block in self._slot_of

    def blocks(self) -> list[int]:
        return list(self._slot_of)

    def touch(self, block: int) -> int | None:
        slot = self._slot_of.get(block)
        if slot is not None:
            self._slot_of.move_to_end(block)
        return slot

    def put(self, block: int) -> tuple[int, int | None] | None:
        """A slot for ``block`` (which must not be here) and the block evicted to free it: the
        least recently used one not ``pinned``. ``None`` when every block is pinned."""
        evicted = None
        if not self._free:
            evicted = next((b for b in self._slot_of if b not in self.pinned), None)
            if evicted is None:
                return None
            self._free.append(self._slot_of.pop(evicted))
        slot = self._free.pop()
        self._slot_of[block] = slot
        return slot, evicted

    def clear(self) -> None:
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._slot_of.clear()


@dataclass
class TierPrices:
    """What loading costs against computing, measured on this rank's clock: an exponentially
    weighted rate per tier (bytes/s), the store's round trip and prefill's rate (tokens/s),
    each starting from a prior until its first reading."""

    host_bytes_per_s: float = 10e9
    store_bytes_per_s: float = 1e9
    prefill_tokens_per_s: float = 5_000.0
    store_latency_s: float = 0.001  # one round trip to the store (its ``exists`` call)
    measured: dict[str, bool] = field(default_factory=dict)
    weight: float = 0.2  # of the newest reading

    def observe(self, what: str, amount: float, seconds: float) -> None:
        if amount <= 0 or seconds <= 0:
            return
        name = {
            "host": "host_bytes_per_s",
            "store": "store_bytes_per_s",
            "prefill": "prefill_tokens_per_s",
            "latency": "store_latency_s",  # amount 1: the reading is the round trip itself
        }[what]
        rate = seconds if what == "latency" else amount / seconds
        if not self.measured.get(what):
            setattr(self, name, rate)
            self.measured[what] = True
        else:
            setattr(self, name, (1 - self.weight) * getattr(self, name) + self.weight * rate)

    def worth_loading(self, tier: str, num_pages: int, page_bytes: int, page_size: int) -> bool:
        """Whether ``num_pages`` of ``tier`` load faster than their tokens compute: a store
        lookup costs one round trip (``store_latency_s``) plus the bytes at the store's rate."""
        if tier == "host":
            load_s = num_pages * page_bytes / self.host_bytes_per_s
        else:
            load_s = self.store_latency_s + num_pages * page_bytes / self.store_bytes_per_s
        return load_s < num_pages * page_size / self.prefill_tokens_per_s


@dataclass(frozen=True)
class TierConfig:
    """A rank's lower tiers: ``host_pages`` slots (0: none), the store client (``None``: none),
    the model's name in store keys, and the pool's layout (``page_bytes`` a page, all layers;
    ``boundary_bytes``, a page's boundary state, which a share ``boundary_share`` of the pages
    carry: DeepSeek-V4).
    ``secret`` authenticates the store's blocks and keys them (``engine/kv_block_codec.py``):
    the deployment's, the same on every rank; empty, a random one of this process's own (its
    blocks are then readable by nobody else)."""

    host_pages: int
    store: KVStore | None
    model: str
    layout: BlockLayout
    page_bytes: int
    store_retry_s: float = 5.0
    boundary_bytes: int = 0
    boundary_share: float = 0.0
    store_timeout_s: float = 2.0  # the longest a request waits for the store's answer
    # what the answer takes to reach the loop besides the store's own time (thread wake-ups, the
    # interpreter's switch interval while the loop thread computes, a busy host's scheduling):
    # added to recompute's price. At 20 ms, answers of a healthy store on a loaded 2-core host
    # came late and backed the store off; a request waits at most this much past recomputing
    answer_slack_s: float = 0.1
    prices: TierPrices = field(default_factory=TierPrices)
    secret: bytes = field(default=b"", repr=False)
    fetched_bytes: int = 256 << 20  # answered fetches held for their requests, at most


class KVTiers:
    """The host tier and the store client of one rank, with the ops and events they produce."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self.prices = config.prices
        self.secret = config.secret or os.urandom(32)
        self.host = HostTier(config.host_pages) if config.host_pages > 0 else None
        self.boundary: BoundarySlots | None = None  # a model's boundary state apart from its pages
        self._host_boundary: set[int] = set()  # host blocks whose slot holds their boundary state
        # what loading a page moves on average: its entries, and its boundary state on a share
        self.page_price_bytes = round(config.page_bytes + config.boundary_share * config.boundary_bytes)
        self.store = config.store
        self.writer = (
            StoreWriter(config.store, retry_s=config.store_retry_s) if config.store is not None else None
        )
        self._ops: list[TierOp] = []
        self._events: list[KVEvent] = []
        self._in_store: OrderedDict[int, None] = OrderedDict()  # blocks known to be there
        self.store_down_until = 0.0
        self.page_size = config.layout.page_size
        self.reader = None
        if config.store is not None:
            checks = ReadChecks(
                self.secret, config.model, config.layout, config.page_bytes, config.boundary_bytes
            )
            self.reader = StoreReader(
                config.store, checks, self._worth_loading, lambda: self.store_down_until
            )
        # (first block asked, last block) -> its fetch, oldest first
        self._fetches: OrderedDict[tuple[int, int], StoreFetch] = OrderedDict()
        self.host_load_bytes = self.store_load_bytes = 0
        self.host_load_s = self.store_load_s = 0.0
        self.store_errors = self.store_rejected = self.recomputed_tokens = 0
        self.store_slow = 0  # fetches answered after their deadline, or never (not errors)
        self._closed = False

    # -- decisions (loop thread) ----------------------------------------------------------------

    def evicted(self, page_id: int, block: int) -> None:
        """The device evicts ``page_id`` (holding ``block``): keep it in a host slot."""
        if self.host is None or block in self.host:
            if self.host is not None:
                self.host.touch(block)
            return
        placed = self.host.put(block)
        if placed is None:  # every slot holds a block being loaded: this one is not kept
            return
        slot, dropped = placed
        window = _slot_of(self.boundary, page_id)
        self._ops.append(TierOp("save", page_id, slot=slot, block=block, window_slot=window))
        if window >= 0:
            self._host_boundary.add(block)
        if dropped is not None:
            self._host_boundary.discard(dropped)
            self._events.append(BlockRemoved((dropped,), "host"))
        self._events.append(BlockStored((block,), None, self.page_size, "host"))

    def computed(self, page_id: int, chain: ChainBlock) -> None:
        """``page_id`` was filled with ``chain``'s KV by the forward just run: write it to the
        store once."""
        if self.writer is None or chain.block in self._in_store:
            return
        self._remember_in_store(chain.block)
        window = _slot_of(self.boundary, page_id)
        op = TierOp("write", page_id, block=chain.block, parent=chain.parent, tokens=chain.tokens)
        self._ops.append(dataclasses.replace(op, window_slot=window))

    def prefetch(self, chain: Sequence[ChainBlock], on_device: Sequence[bool]) -> StoreFetch | None:
        """``None`` when ``lookup`` of ``chain`` may run now: the store answered for the run past
        the device and the host, or was too slow (a miss, the store backed off), or there is
        nothing to ask. Else the fetch under way (asked here, once), for the caller to wait on
        and ask again once it is ``settled``."""
        index = self._first_for_store(chain, on_device)
        if index is None or self.reader is None:
            return None
        key = (chain[index].block, chain[-1].block)
        fetch = self._fetches.get(key)
        if fetch is None:
            wanted = len(chain) - index
            if not self._store_up() or not self.prices.worth_loading(
                "store", wanted, self.page_price_bytes, self.page_size
            ):
                return None  # down, or slower than computing even if it held every block
            return self._ask(key, tuple(chain[index:]))
        if fetch.done.is_set():
            return None
        if time.monotonic() < self.store_down_until:  # backed off since: no use waiting
            del self._fetches[key]
            return None
        if time.monotonic() > fetch.deadline_s:
            self._overdue(key, fetch)
            return None
        return fetch

    def lookup(self, chain: Sequence[ChainBlock], on_device: Sequence[bool]) -> LowerMatch:
        """The leading run of ``chain`` that the device (``on_device``), the host tier or the
        store holds and that is worth loading; store blocks only as ``prefetch`` fetched and
        checked them (this never calls the store)."""
        match = LowerMatch()
        page, size = self.page_price_bytes, self.page_size
        load_host = self.host is not None and self.prices.worth_loading("host", 1, page, size)
        for index, (block, device) in enumerate(zip(chain, on_device, strict=True)):
            if device:
                match.order.append("device")
            elif self.host is not None and block.block in self.host:
                if not load_host:
                    self.recomputed_tokens += (len(chain) - index) * size
                    break
                match.order.append("host")
            else:
                self._take_fetched(chain[index:], match)
                break
        for block, kind in zip(chain, match.order, strict=False):
            if kind == "host":
                assert self.host is not None
                slot = self.host.touch(block.block)
                assert slot is not None
                match.host.append((block, slot))
                self.host.pinned.add(block.block)
        return match

    def end_lookup(self) -> None:
        """The lookup's loads are recorded: its host blocks may be evicted again."""
        if self.host is not None:
            self.host.pinned.clear()

    def loaded(self, kind: str, page_id: int, block: int, slot: int = -1, payload: bytes = b"") -> None:
        """Record the copy of one block's KV into ``page_id`` (a host ``slot`` or a payload), and
        of its boundary state where it carries one, into the slot the model gives the page."""
        carries = block in self._host_boundary if kind == "host" else len(payload) > self.config.page_bytes
        window = -1
        if self.boundary is not None:
            taken = self.boundary.take(page_id, carries)
            window = -1 if taken is None or not carries else taken
        if kind == "host":
            self._ops.append(TierOp("load", page_id, slot=slot, block=block, window_slot=window))
        else:
            self._remember_in_store(block)
            self._ops.append(TierOp("fill", page_id, block=block, payload=payload, window_slot=window))

    def still_in_host(self, block: int, slot: int) -> bool:
        """Whether ``block`` still has ``slot`` (an eviction since the lookup may have taken it)."""
        return self.host is not None and self.host.touch(block) == slot

    def take_ops(self) -> list[TierOp]:
        ops, self._ops = self._ops, []
        return ops

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        if self.writer is not None:
            written = self.writer.take_written()
            if written:
                events.append(BlockStored(tuple(written), None, self.page_size, "store"))
        return events

    def store_blocks(self) -> list[int]:
        """Blocks this rank wrote to or read from the store (the store may have evicted some)."""
        return list(self._in_store)

    def host_blocks(self) -> list[int]:
        return [] if self.host is None else self.host.blocks()

    def clear_host(self) -> None:
        if self.host is not None:
            self.host.clear()
        self._host_boundary.clear()

    # -- figures --------------------------------------------------------------------------------

    def observe_load(self, tier: str, num_bytes: int, seconds: float) -> None:
        if tier == "host":
            self.host_load_bytes += num_bytes
            self.host_load_s += seconds
        else:
            self.store_load_bytes += num_bytes
            self.store_load_s += seconds
        self.prices.observe(tier, num_bytes, seconds)

    def stats(self) -> TierStats:
        w = self.writer
        return TierStats(
            host_pages_total=self.host.num_slots if self.host else 0,
            host_pages_used=len(self.host) if self.host else 0,
            host_load_bytes=self.host_load_bytes,
            host_load_s=self.host_load_s,
            store_load_bytes=self.store_load_bytes,
            store_load_s=self.store_load_s,
            store_write_bytes=w.write_bytes if w else 0,
            store_write_s=w.write_s if w else 0.0,
            store_writes=w.writes if w else 0,
            store_errors=self.store_errors + (w.errors + w.dropped if w else 0),
            store_rejected=self.store_rejected,
            store_slow=self.store_slow,
            recomputed_tokens=self.recomputed_tokens,
            host_bytes_per_s=self.prices.host_bytes_per_s if self.prices.measured.get("host") else 0.0,
            store_bytes_per_s=self.prices.store_bytes_per_s if self.prices.measured.get("store") else 0.0,
            prefill_tokens_per_s=self.prices.prefill_tokens_per_s
            if self.prices.measured.get("prefill")
            else 0.0,
            kv_bytes_per_token=self.page_price_bytes // self.page_size,
        )

    def key(self, block: int) -> str:
        """The store key of ``block`` in this deployment (keyed by its secret)."""
        return store_key(self.secret, self.config.model, self.config.layout, block)

    def encode(self, op: TierOp, payload: bytes) -> tuple[str, bytes]:
        c, key = self.config, self.key(op.block)
        return key, encode_block(
            self.secret, StoredBlock(key, op.parent, op.tokens), c.model, c.layout, payload
        )

    def write(self, op: TierOp, payload: bytes) -> None:
        """Hand ``op``'s page bytes to the writer thread, which encodes (signs) and stores them:
        the loop pays for the copy out of the pool only."""
        if self.writer is not None:
            key = self.key(op.block)
            self.writer.submit(op.block, key, lambda: self.encode(op, payload)[1])

    def close(self) -> None:
        """Stop the writer (bounded) and the reader, and leave the store; once."""
        if self._closed:
            return
        self._closed = True
        if self.writer is not None:
            self.writer.close()
        if self.reader is not None:
            self.reader.close()
        if self.store is not None:
            try:
                self.store.close()
            except Exception as error:  # a rank that stops must not fail on its way out
                log.warning("KV store client did not close cleanly: %s", error)

    # -- the store ------------------------------------------------------------------------------

    def _first_for_store(self, chain: Sequence[ChainBlock], on_device: Sequence[bool]) -> int | None:
        """Where the store's part of ``chain`` begins (``lookup``'s walk): ``None`` when the run
        ends before it (a host block not worth loading) or when the store has no part."""
        load_host = self.host is not None and self.prices.worth_loading(
            "host", 1, self.page_price_bytes, self.page_size
        )
        for index, (block, device) in enumerate(zip(chain, on_device, strict=True)):
            if device:
                continue
            if self.host is not None and block.block in self.host:
                if not load_host:
                    return None
                continue
            return index
        return None

    def _worth_loading(self, num_pages: int) -> bool:
        """Loading ``num_pages`` blocks from the store is priced faster than computing them."""
        return self.prices.worth_loading("store", num_pages, self.page_price_bytes, self.page_size)

    def _store_up(self) -> bool:
        busy = self.reader.busy_since if self.reader is not None else 0.0
        if busy and time.monotonic() - busy > self.config.store_timeout_s:
            return False  # the reader is still stuck in a call that timed out
        return time.monotonic() >= self.store_down_until

    def _ask(self, key: tuple[int, int], chain: tuple[ChainBlock, ...]) -> StoreFetch:
        assert self.reader is not None
        c, now = self.config, time.monotonic()
        recompute_s = len(chain) * self.page_size / self.prices.prefill_tokens_per_s
        fetch = StoreFetch(
            chain,
            tuple(self.key(b.block) for b in chain),
            asked_s=now,
            deadline_s=now + min(c.store_timeout_s, recompute_s + c.answer_slack_s),
        )
        self._trim()
        self._fetches[key] = fetch
        self.reader.submit(fetch)
        return fetch

    def _trim(self) -> None:
        """Answered fetches nobody took (their request left, or its lookup went another way)
        are dropped, oldest first, beyond ``fetched_bytes`` of payloads."""
        held = 0
        for key, fetch in reversed(list(self._fetches.items())):
            if not fetch.done.is_set():
                continue
            held += fetch.raw_bytes
            if held > self.config.fetched_bytes or len(self._fetches) > 4096:
                del self._fetches[key]

    def _overdue(self, key: tuple[int, int], fetch: StoreFetch) -> None:
        """No answer by the deadline: a miss; the store, slower than its price, is backed off."""
        del self._fetches[key]
        self._store_slow(f"no answer within {fetch.deadline_s - fetch.asked_s:.3f} s")

    def _take_fetched(self, chain: Sequence[ChainBlock], match: LowerMatch) -> None:
        """The answered fetch of ``chain``'s run, settled once: its checked payloads into
        ``match``, its figures into the counters and prices."""
        key = (chain[0].block, chain[-1].block)
        fetch = self._fetches.get(key)
        if fetch is None:
            return
        if not fetch.done.is_set():
            if time.monotonic() > fetch.deadline_s:
                self._overdue(key, fetch)
            return  # asked for a request still waiting on it: this lookup goes without
        del self._fetches[key]
        self.store_rejected += fetch.rejected
        self.recomputed_tokens += fetch.recomputed * self.page_size
        if fetch.error is not None:
            self._store_failed(fetch.error)
            return
        if fetch.skipped:
            return
        if fetch.answered_s > fetch.deadline_s:
            self._store_slow(f"answered in {fetch.answered_s - fetch.asked_s:.3f} s, past its price")
            return
        self.prices.observe("latency", 1, fetch.exists_s)
        if fetch.payloads:
            self.observe_load("store", fetch.raw_bytes, fetch.get_s)
        for block, payload in zip(chain, fetch.payloads, strict=False):
            match.order.append("store")
            match.store.append((block, payload))

    def _store_failed(self, reason: str) -> None:
        log.warning(
            "KV store unavailable, computing instead for %.0f s: %s", self.config.store_retry_s, reason
        )
        self.store_errors += 1
        self.store_down_until = time.monotonic() + self.config.store_retry_s

    def _store_slow(self, reason: str) -> None:
        """A fetch slower than recomputing: a miss, counted apart from failures, and the store is
        left alone for ``store_retry_s`` as after one."""
        log.warning(
            "KV store slower than computing, computing instead for %.0f s: %s",
            self.config.store_retry_s,
            reason,
        )
        self.store_slow += 1
        self.store_down_until = time.monotonic() + self.config.store_retry_s

    def _remember_in_store(self, block: int) -> None:
        self._in_store[block] = None
        self._in_store.move_to_end(block)
        if len(self._in_store) > 1 << 20:
            self._in_store.popitem(last=False)
