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
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from tandem.engine.kv_block_codec import BlockLayout, BlockRejected, decode_block, encode_block, store_key
from tandem.engine.prefix_cache import ChainBlock, LowerMatch
from tandem.kvtransfer.kv_store import KVStore, StoreError
from tandem.wire.kv_events import BlockRemoved, BlockStored, KVEvent
from tandem.wire.messages import TierStats

log = logging.getLogger(__name__)

OpKind = Literal["save", "load", "fill", "write"]
T = TypeVar("T")


@dataclass(frozen=True)
class TierOp:
    """One copy: ``save`` device page -> host ``slot``; ``load`` host ``slot`` -> device page;
    ``fill`` a checked store ``payload`` -> device page; ``write`` device page -> the store, as
    ``block`` (child of ``parent``, holding ``tokens``)."""

    kind: OpKind
    page_id: int
    slot: int = -1
    block: int = 0
    parent: int | None = None
    tokens: tuple[int, ...] = ()
    payload: bytes = b""


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


class StoreWriter:
    """Writes blocks to the store from a thread of its own, a bounded queue in front: a full
    queue drops the block (counted), it never blocks the loop. After a failed write the blocks
    queued in the next ``retry_s`` are dropped (counted) without calling the store, so a store
    that is down costs one failed call per ``retry_s``, not one per block."""

    def __init__(self, store: KVStore, max_queued: int = 1024, retry_s: float = 5.0) -> None:
        self._store = store
        self.retry_s = retry_s
        self._down_until = 0.0
        self._queue: queue.Queue[tuple[int, str, bytes] | None] = queue.Queue(max_queued)
        self._done: list[int] = []  # blocks written, for the loop to publish
        self._lock = threading.Lock()
        self.writes = self.write_bytes = self.errors = self.dropped = 0
        self.write_s = 0.0
        self._thread = threading.Thread(target=self._run, name="kv-store-writer", daemon=True)
        self._thread.start()

    def submit(self, block: int, key: str, value: bytes) -> bool:
        try:
            self._queue.put_nowait((block, key, value))
            return True
        except queue.Full:
            with self._lock:
                self.dropped += 1
            return False

    def take_written(self) -> list[int]:
        with self._lock:
            done, self._done = self._done, []
        return done

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued block is written or failed (for tests and shutdown)."""
        deadline = time.monotonic() + timeout_s
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=10.0)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                block, key, value = item
                start = time.monotonic()
                if start < self._down_until:
                    with self._lock:
                        self.dropped += 1
                    continue
                try:
                    self._store.put(key, value)
                except StoreError as error:
                    log.warning(
                        "KV store write of %s failed, dropping writes for %.0f s: %s",
                        key,
                        self.retry_s,
                        error,
                    )
                    self._down_until = time.monotonic() + self.retry_s
                    with self._lock:
                        self.errors += 1
                    continue
                with self._lock:
                    self.writes += 1
                    self.write_bytes += len(value)
                    self.write_s += time.monotonic() - start
                    self._done.append(block)
            finally:
                self._queue.task_done()


@dataclass(frozen=True)
class TierConfig:
    """A rank's lower tiers: ``host_pages`` slots (0: none), the store client (``None``: none),
    the model's name in store keys, and the pool's layout (``page_bytes`` a page, all layers)."""

    host_pages: int
    store: KVStore | None
    model: str
    layout: BlockLayout
    page_bytes: int
    store_retry_s: float = 5.0
    store_timeout_s: float = 2.0  # a lookup's store call that takes longer is a failure
    prices: TierPrices = field(default_factory=TierPrices)


class KVTiers:
    """The host tier and the store client of one rank, with the ops and events they produce."""

    def __init__(self, config: TierConfig) -> None:
        self.config = config
        self.prices = config.prices
        self.host = HostTier(config.host_pages) if config.host_pages > 0 else None
        self.store = config.store
        self.writer = (
            StoreWriter(config.store, retry_s=config.store_retry_s) if config.store is not None else None
        )
        self._ops: list[TierOp] = []
        self._events: list[KVEvent] = []
        self._in_store: OrderedDict[int, None] = OrderedDict()  # blocks known to be there
        self._store_down_until = 0.0
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-store-reader") if config.store else None
        self._pending: Future[Any] | None = None  # a read that timed out and may still run
        self.page_size = config.layout.page_size
        self.host_load_bytes = self.store_load_bytes = 0
        self.host_load_s = self.store_load_s = 0.0
        self.store_errors = self.store_rejected = self.recomputed_tokens = 0

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
        self._ops.append(TierOp("save", page_id, slot=slot, block=block))
        if dropped is not None:
            self._events.append(BlockRemoved((dropped,), "host"))
        self._events.append(BlockStored((block,), None, self.page_size, "host"))

    def computed(self, page_id: int, chain: ChainBlock) -> None:
        """``page_id`` was filled with ``chain``'s KV by the forward just run: write it to the
        store once."""
        if self.writer is None or chain.block in self._in_store:
            return
        self._remember_in_store(chain.block)
        self._ops.append(
            TierOp("write", page_id, block=chain.block, parent=chain.parent, tokens=chain.tokens)
        )

    def lookup(self, chain: Sequence[ChainBlock], on_device: Sequence[bool]) -> LowerMatch:
        """The leading run of ``chain`` that the device (``on_device``), the host tier or the
        store holds and that is worth loading; store blocks are read and checked here."""
        match = LowerMatch()
        page, size = self.config.page_bytes, self.page_size
        load_host = self.host is not None and self.prices.worth_loading("host", 1, page, size)
        wanted: list[int] = []  # indexes of blocks to ask the store for
        for index, (block, device) in enumerate(zip(chain, on_device, strict=True)):
            if device:
                match.order.append("device")
            elif self.host is not None and block.block in self.host:
                if not load_host:
                    self.recomputed_tokens += (len(chain) - index) * size
                    break
                match.order.append("host")
            else:
                wanted = list(range(index, len(chain)))
                break
        if wanted and self.store is not None and self._store_up():
            self._read_store(chain, wanted, match)
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
        """Record the copy of one block's KV into ``page_id`` (a host ``slot`` or a payload)."""
        if kind == "host":
            self._ops.append(TierOp("load", page_id, slot=slot, block=block))
        else:
            self._remember_in_store(block)
            self._ops.append(TierOp("fill", page_id, block=block, payload=payload))

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
            recomputed_tokens=self.recomputed_tokens,
            host_bytes_per_s=self.prices.host_bytes_per_s if self.prices.measured.get("host") else 0.0,
            store_bytes_per_s=self.prices.store_bytes_per_s if self.prices.measured.get("store") else 0.0,
            prefill_tokens_per_s=self.prices.prefill_tokens_per_s
            if self.prices.measured.get("prefill")
            else 0.0,
            kv_bytes_per_token=self.config.page_bytes // self.page_size,
        )

    def encode(self, op: TierOp, payload: bytes) -> tuple[str, bytes]:
        c = self.config
        return store_key(c.model, c.layout, op.block), encode_block(
            c.model, c.layout, op.block, op.parent, op.tokens, payload
        )

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        if self._reader is not None:
            self._reader.shutdown(wait=False)
        if self.store is not None:
            self.store.close()

    # -- the store ------------------------------------------------------------------------------

    def _store_up(self) -> bool:
        if self._pending is not None and not self._pending.done():
            return False  # the reader is still stuck in a call that timed out
        self._pending = None
        return time.monotonic() >= self._store_down_until

    def _call(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` on the reader thread, at most ``store_timeout_s``: a slow store fails
        the lookup (a miss) instead of holding the rank's loop."""
        assert self._reader is not None
        future = self._reader.submit(fn, *args)
        try:
            return future.result(timeout=self.config.store_timeout_s)
        except FutureTimeout:
            self._pending = future
            raise StoreError(f"no answer within {self.config.store_timeout_s} s") from None

    def _store_failed(self, error: StoreError) -> None:
        log.warning(
            "KV store unavailable, computing instead for %.0f s: %s", self.config.store_retry_s, error
        )
        self.store_errors += 1
        self._store_down_until = time.monotonic() + self.config.store_retry_s

    def _read_store(self, chain: Sequence[ChainBlock], wanted: list[int], match: LowerMatch) -> None:
        """Ask the store for the run's blocks (one ``exists``), price the run, read it (one
        batched ``get``) and check each block; the run stops at the first missing or bad one."""
        assert self.store is not None
        c = self.config
        keys = [store_key(c.model, c.layout, chain[i].block) for i in wanted]
        start = time.monotonic()
        try:
            present = self._call(self.store.exists, keys)
        except StoreError as error:
            self._store_failed(error)
            return
        asked = time.monotonic()
        self.prices.observe("latency", 1, asked - start)
        run = 0
        while run < len(present) and present[run]:
            run += 1
        if run == 0:
            return
        if not self.prices.worth_loading("store", run, c.page_bytes, self.page_size):
            self.recomputed_tokens += run * self.page_size
            return
        try:
            values = self._call(self.store.get_many, keys[:run])
        except StoreError as error:
            self._store_failed(error)
            return
        got = 0
        for index, key, raw in zip(wanted[:run], keys[:run], values, strict=True):
            block = chain[index]
            if raw is None:  # evicted from the store since ``exists``
                break
            try:
                payload = decode_block(
                    raw,
                    model=c.model,
                    layout=c.layout,
                    block=block.block,
                    parent=block.parent,
                    payload_bytes=c.page_bytes,
                )
            except BlockRejected as error:
                log.warning("KV store block %s rejected: %s", key, error)
                self.store_rejected += 1
                break
            match.order.append("store")
            match.store.append((block, payload))
            got += len(raw)
        if got:
            self.observe_load("store", got, time.monotonic() - asked)

    def _remember_in_store(self, block: int) -> None:
        self._in_store[block] = None
        self._in_store.move_to_end(block)
        if len(self._in_store) > 1 << 20:
            self._in_store.popitem(last=False)
