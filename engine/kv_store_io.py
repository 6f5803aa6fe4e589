"""The shared store's two threads of a rank: the writer (a bounded queue of blocks to ``put``)
and the reader (``StoreFetch``es answered together in one ``exists`` and one ``get_many``). The
loop thread only hands them work and reads their answers: a slow or hung store holds these
threads, never the loop (``engine/kv_tiers.py`` decides what they do). Torch-free."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.engine.kv_block_codec import BlockLayout, BlockRejected, StoredBlock, decode_block
from tandem.engine.prefix_cache import ChainBlock
from tandem.kvtransfer.kv_store import KVStore, StoreError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ReadChecks:
    """What a block read back must hold to be used: a tag of the deployment's ``secret``, the
    ``model`` and ``layout`` this rank expects, a page of ``page_bytes`` (with ``boundary_bytes``:
    or of both, a DeepSeek-V4 page with its boundary state)."""

    secret: bytes = field(repr=False)
    model: str
    layout: BlockLayout
    page_bytes: int
    boundary_bytes: int = 0

    @property
    def sizes(self) -> tuple[int, ...]:
        if not self.boundary_bytes:
            return (self.page_bytes,)
        return (self.page_bytes, self.page_bytes + self.boundary_bytes)


class StoreWriter:
    """Writes blocks to the store from a thread of its own, a bounded queue in front: a full
    queue drops the block (counted), it never blocks the loop. After a failed write the blocks
    queued in the next ``retry_s`` are dropped (counted) without calling the store, so a store
    that is down costs one failed call per ``retry_s``, not one per block."""

    def __init__(self, store: KVStore, max_queued: int = 1024, retry_s: float = 5.0) -> None:
        self._store = store
        self.retry_s = retry_s
        self._down_until = 0.0
        self._queue: queue.Queue[tuple[int, str, bytes | Callable[[], bytes]] | None] = queue.Queue(
            max_queued
        )
        self._done: list[int] = []  # blocks written, for the loop to publish
        self._lock = threading.Lock()
        self.writes = self.write_bytes = self.errors = self.dropped = 0
        self.write_s = 0.0
        self._thread = threading.Thread(target=self._run, name="kv-store-writer", daemon=True)
        self._thread.start()

    def submit(self, block: int, key: str, value: bytes | Callable[[], bytes]) -> bool:
        """Queue ``value`` (or what calling it gives, on this writer's thread) for ``key``;
        ``False`` when the queue is full and the block is dropped."""
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

    def close(self, timeout_s: float = 2.0) -> None:
        """Stop the thread once what is queued is written, waiting at most ``timeout_s`` in all:
        a full queue before a hung store call never holds the caller (the daemon thread, and
        what it still holds, are left behind)."""
        deadline = time.monotonic() + timeout_s
        try:
            self._queue.put(None, timeout=timeout_s)
        except queue.Full:
            log.warning("KV store writer: %d writes still queued at close, left", self._queue.qsize())
        self._thread.join(timeout=max(0.0, deadline - time.monotonic()))

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
                if callable(value):
                    value = value()
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


@dataclass(eq=False)
class StoreFetch:
    """One run of a chain asked of the store (from its first block on neither the device nor the
    host), and the reader's answer. The reader thread writes the answer fields, then ``done``;
    the loop reads them only once ``done`` is set."""

    chain: tuple[ChainBlock, ...]
    keys: tuple[str, ...]
    asked_s: float  # when the loop asked
    deadline_s: float  # an answer later than this is a miss, and the store is backed off
    done: threading.Event = field(default_factory=threading.Event)
    answered_s: float = 0.0
    payloads: list[bytes] = field(default_factory=list)  # the checked leading run
    raw_bytes: int = 0
    exists_s: float = 0.0  # the ``exists`` round trip
    get_s: float = 0.0  # the ``get_many`` of the run
    recomputed: int = 0  # blocks there but priced slower than computing
    rejected: int = 0
    error: str | None = None
    skipped: bool = False  # not asked: the store was backed off when the reader got to it

    def settled(self) -> bool:
        """Answered, or past its deadline: the request waiting on it may go on."""
        return self.done.is_set() or time.monotonic() > self.deadline_s


class StoreReader:
    """Answers ``StoreFetch``es from a thread of its own. The fetches queued when it looks are
    answered together: one ``exists`` for all their keys, the price of each run there
    (``TierPrices.worth_loading``), one ``get_many`` of the runs worth loading, and
    ``decode_block`` of each block against its request's own tokens. So requests that arrive
    together wait one round trip, not one each. The loop only submits and reads answers: a slow
    or hung store holds this thread, never the loop."""

    def __init__(
        self,
        store: KVStore,
        checks: ReadChecks,
        worth_loading: Callable[[int], bool],
        down_until: Callable[[], float],
    ) -> None:
        """``worth_loading(n)``: whether loading ``n`` blocks is priced faster than computing
        them; ``down_until()``: until when the store is backed off (no call before)."""
        self._store = store
        self._checks = checks
        self._worth_loading = worth_loading
        self._down_until = down_until
        self._queue: queue.Queue[StoreFetch | None] = queue.Queue()
        self.busy_since = 0.0  # when the call under way began (0: none)
        self._thread = threading.Thread(target=self._run, name="kv-store-reader", daemon=True)
        self._thread.start()

    def submit(self, fetch: StoreFetch) -> None:
        self._queue.put(fetch)

    def close(self, timeout_s: float = 1.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)

    def _run(self) -> None:
        closing = False
        while not closing:
            batch = [self._queue.get()]
            while True:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            closing = None in batch
            fetches = [f for f in batch if f is not None]
            if not fetches:
                continue
            try:
                if time.monotonic() < self._down_until():
                    for fetch in fetches:
                        fetch.skipped = True
                else:
                    self.busy_since = time.monotonic()
                    self._answer(fetches)
            except StoreError as error:
                for fetch in fetches:
                    fetch.error = str(error)
            except Exception as error:  # a bug here must not leave the requests waiting
                log.exception("KV store read failed")
                for fetch in fetches:
                    fetch.error = f"{type(error).__name__}: {error}"
            finally:
                self.busy_since = 0.0
                now = time.monotonic()
                for fetch in fetches:
                    fetch.answered_s = now
                    fetch.done.set()

    def _answer(self, fetches: list[StoreFetch]) -> None:
        c = self._checks
        start = time.monotonic()
        present = iter(self._store.exists([key for f in fetches for key in f.keys]))
        exists_s = time.monotonic() - start
        runs: list[int] = []  # per fetch: the leading blocks to read
        for fetch in fetches:
            there = [next(present) for _ in fetch.keys]
            run = next((i for i, found in enumerate(there) if not found), len(there))
            fetch.exists_s = exists_s
            if run and not self._worth_loading(run):
                fetch.recomputed, run = run, 0
            runs.append(run)
        wanted = [key for fetch, run in zip(fetches, runs, strict=True) for key in fetch.keys[:run]]
        if not wanted:
            return
        start = time.monotonic()
        values = iter(self._store.get_many(wanted))
        get_s = time.monotonic() - start
        for fetch, run in zip(fetches, runs, strict=True):
            raws = [next(values) for _ in range(run)]
            for block, key, raw in zip(fetch.chain, fetch.keys, raws, strict=False):
                if raw is None:  # evicted from the store since ``exists``
                    break
                try:
                    payload = decode_block(
                        raw,
                        secret=c.secret,
                        block=StoredBlock(key, block.parent, block.tokens),
                        model=c.model,
                        layout=c.layout,
                        payload_bytes=c.sizes,
                    )
                except BlockRejected as error:
                    log.warning("KV store block %s rejected: %s", key, error)
                    fetch.rejected += 1
                    break
                fetch.payloads.append(payload)
                fetch.raw_bytes += len(raw)
            fetch.get_s = get_s * run / len(wanted)  # its share of the one call
