"""Stand-ins for a deployment's controller and ranks that make tokens without a model, so that a
real frontend can be driven as hard as it can go (``bench/host_frontend.py``).

A :class:`FakeDecodeRank` takes the frontend's submits on the channel the frontend opens to it (a
decode rank's, ``cluster/channel_server.py``), sends each request's prompt as a
:class:`PrefillJob` to the prefill rank the router chose (as ``decode/worker.py`` does, an actor
call ``submit([job])``), and after each of its steps pushes the frontend one :class:`StreamBatch`
with one new token for every running request and the :class:`RequestResult` (with its
:class:`Bill`) of each request that reached its ``max_tokens``: the message, the path (the
frontend's channel, as a decode rank's outbox uses) and the one batch a step per frontend
are those of ``decode/worker.py``'s ``publish``. A request's tokens are the workload's output for
its prompt (``bench/frontend_workload.py``). A step takes at least ``step_s`` (the stand-in for a
decode forward: every running stream gets its token a step, as on a deployment, so a push carries
a token of each), and waits while the channel holds back bytes the frontend has not read: with a
short ``step_s`` the ranks offer more tokens than the frontend
takes, and the frontend is what limits the tokens per second.

A :class:`FakePrefillRank` computes no KV but keeps a real prefix cache (``PrefixCache``) of a
fixed number of pages: each job's new full pages are cached under their block hashes, the least
recently used evicted when the pool is full, and the cache's KV events (``BlockStored``,
``BlockRemoved``) go to every subscribed frontend as a prefill rank's do (``prefill/worker.py``
``publish``: a ``KVEventBatch`` on the subscriber's channel through a ``ChannelOutbox``), so the
frontend's router indexes what the ranks hold and its prefix matches are real.

::

    frontend ──submit([RankRequest])──▶ FakeDecodeRank ──submit([PrefillJob])──▶ FakePrefillRank
      ▲ ▲                                      │ each step, a                           │ a prefix cache,
      │ └────────── StreamBatch on the channel ◀┘ token a stream                       │ no compute
      └──────────────── KVEventBatch on the channel ◀───────────────────────────────────┘
    frontend ──Subscribe──▶ FakePrefillRank     frontend ──routing_view──▶ FakeController
"""

from __future__ import annotations

import asyncio
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from tandem.bench.frontend_workload import FrontendWorkload
from tandem.cluster.channel_server import ChannelServer
from tandem.cluster.outbox import ChannelOutbox
from tandem.engine.kv_event_publisher import KVEventPublisher
from tandem.engine.page_allocator import PageAllocator
from tandem.engine.prefix_cache import PrefixCache
from tandem.kvtransfer.types import KVDestination
from tandem.wire.channel import Endpoint
from tandem.wire.kv_events import BlockRemoved, BlockStored, KVEventBatch
from tandem.wire.messages import (
    Bill,
    PrefillAttempt,
    RankId,
    RankRequest,
    RankStats,
    RequestResult,
    Role,
    StreamBatch,
    StreamColumns,
    TransferId,
)
from tandem.wire.prefill_job import PrefillJob
from tandem.wire.request_params import FinishReason
from tandem.wire.routing_view import FrontendInfo, GroupState, GroupView, RoutingView

FAKE_TOTAL_PAGES = 1 << 20  # a decode rank that never runs out of pages
# a prefill rank's prefix cache: 262,144 tokens, which a few rounds of 256 prompts of 1-4k fill
FAKE_PREFILL_PAGES = 4096
PAGE_SIZE = 64
INCARNATION = 1  # of every fake rank: the controller's view says so, and the KV events
KV_DEADLINE_S = 30.0


@dataclass
class _Stream:
    """One request on a fake decode rank: its tokens so far and when each was made."""

    request: RankRequest
    arrival_s: float
    start: int  # of its output in the workload's stream
    times_s: list[float] = field(default_factory=list)
    aborted: bool = False

    @property
    def produced(self) -> int:
        return len(self.times_s)


@dataclass(frozen=True)
class FakeRankCounts:
    """What a fake decode rank did: steps, pushes sent, tokens and results in them."""

    steps: int
    pushes: int
    tokens: int
    results: int


def _check(items: list[RankRequest]) -> None:
    for request in items:
        if request.frontend is None:
            raise ValueError(f"request {request.request_id}: frontend: expected the frontend's name")


@dataclass(frozen=True)
class FakePrefillCounts:
    """What a fake prefill rank did: jobs taken, KV event batches pushed (one per subscriber and
    submit with events), and blocks its cache stored and removed."""

    jobs: int
    event_batches: int
    blocks_stored: int
    blocks_removed: int


@ray.remote(num_cpus=0)
class FakeDecodeRank:
    """A decode rank without a model: the tokens of each request are the workload's output for
    its prompt; its prompt goes to its prefill rank as a job."""

    def __init__(
        self,
        rank: RankId,
        prefill: dict[RankId, Any],
        workload: FrontendWorkload,
        step_s: float = 0.0,
    ) -> None:
        if not workload.stream_token_ids:
            raise ValueError("workload: expected a stream of at least one token id")
        if not 0 <= step_s <= 1:
            raise ValueError(f"step_s: expected 0 to 1 seconds, got {step_s}")
        self.rank, self.prefill = rank, prefill
        self.workload, self.step_s = workload, step_s
        self.token_ids = workload.stream_token_ids
        self._streams: dict[str, _Stream] = {}
        self._wake = asyncio.Event()
        self._steps = self._pushes = self._tokens = self._results = 0
        self._loop: asyncio.Task[None] | None = None
        self._held = False
        self._channels: ChannelServer | None = None

    async def channel_endpoint(self) -> Endpoint:
        """A channel server as a decode rank's (``cluster/channel_server.py``): its threads check
        the items and hand them, and aborts, to this actor's event loop."""
        if self._channels is None:
            loop = asyncio.get_running_loop()

            def submit(items: list[Any]) -> None:
                _check(items)
                loop.call_soon_threadsafe(self._take, items, time.monotonic())

            def abort(request_ids: list[str]) -> None:
                loop.call_soon_threadsafe(self._abort, request_ids)

            self._channels = ChannelServer(ray.util.get_node_ip_address(), submit, abort)
        return self._channels.endpoint()

    def _take(self, items: list[RankRequest], now: float) -> None:
        if self._loop is None:
            self._loop = asyncio.get_running_loop().create_task(self._run())
        jobs: dict[RankId, list[PrefillJob]] = {}
        for request in items:
            start = self.workload.output_start(request.prompt_token_ids)
            self._streams[request.request_id] = _Stream(request, now, start)
            prefill_rank = request.prefill_rank
            if prefill_rank is not None and prefill_rank in self.prefill:
                jobs.setdefault(prefill_rank, []).append(self._job(request))
        for prefill_rank, batch in jobs.items():
            self.prefill[prefill_rank].submit.remote(batch)  # no wait, as decode/dispatch.py
        self._wake.set()

    def _job(self, request: RankRequest) -> PrefillJob:
        """The job a decode rank sends for a new request, into pages it "reserved"."""
        pages = -(-len(request.prompt_token_ids) // PAGE_SIZE)
        return PrefillJob(
            request_id=TransferId(request.request_id, 1).key,
            prompt_token_ids=request.prompt_token_ids,
            sampling=request.sampling,
            destination=KVDestination(self.rank.name, INCARNATION, tuple(range(pages))),
            deadline_s=time.time() + KV_DEADLINE_S,
            cache_salt=request.cache_salt,
        )

    def _abort(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            stream = self._streams.get(request_id)
            if stream is not None:
                stream.aborted = True
        self._wake.set()

    async def stats(self) -> RankStats:
        return RankStats(
            self.rank,
            Role.DECODE,
            incarnation=INCARNATION,
            running=len(self._streams),
            free_pages=FAKE_TOTAL_PAGES,
            total_pages=FAKE_TOTAL_PAGES,
        )

    async def hold(self) -> None:
        """Take requests but make no step until :meth:`release` (a round starts with every
        stream running, as on a deployment at steady state, however fast the frontend admits)."""
        self._held = True

    async def release(self) -> None:
        self._held = False
        self._wake.set()

    async def running(self) -> int:
        return len(self._streams)

    async def counts(self) -> FakeRankCounts:
        return FakeRankCounts(self._steps, self._pushes, self._tokens, self._results)

    async def _run(self) -> None:
        next_step = time.monotonic()
        while True:
            if not self._streams or self._held:
                self._wake.clear()
                await self._wake.wait()
                next_step = time.monotonic()
                continue
            wait_s = next_step - time.monotonic()
            if wait_s > 0:
                await asyncio.sleep(wait_s)
            next_step = max(next_step + self.step_s, time.monotonic())
            for frontend, batch in self._step().items():
                await self._push(frontend, batch)

    def _step(self) -> dict[str, StreamBatch]:
        """One token for every running request; the batch of each frontend."""
        now, now_unix_s = time.monotonic(), time.time()
        deltas: dict[str, StreamColumns] = {}
        results: dict[str, list[RequestResult]] = {}
        tokens = self.token_ids
        for request_id, stream in list(self._streams.items()):
            frontend = stream.request.frontend
            assert frontend is not None
            if not stream.aborted:
                index = stream.produced
                stream.times_s.append(now)
                columns = deltas.get(frontend) or deltas.setdefault(frontend, StreamColumns())
                token = tokens[(stream.start + index) % len(tokens)]
                columns.add(request_id, index, (token,), (now,), (now_unix_s,))
                self._tokens += 1
            if stream.aborted or stream.produced >= stream.request.sampling.max_tokens:
                del self._streams[request_id]
                results.setdefault(frontend, []).append(self._result(stream, now))
                self._results += 1
        self._steps += 1
        return {
            frontend: deltas.get(frontend, StreamColumns()).batch(self.rank, tuple(results.get(frontend, ())))
            for frontend in deltas.keys() | results.keys()
        }

    def _result(self, stream: _Stream, now: float) -> RequestResult:
        """The result and bill a decode rank reports, with the figures it would fill in."""
        request, produced = stream.request, stream.produced
        tokens = tuple(self.token_ids[(stream.start + i) % len(self.token_ids)] for i in range(produced))
        prompt = len(request.prompt_token_ids)
        times = tuple(t - stream.arrival_s for t in stream.times_s)
        prefill_rank = request.prefill_rank or next(iter(self.prefill))
        attempt = PrefillAttempt(1, prefill_rank, delivered=True, prompt_tokens=prompt)
        bill = Bill(
            prompt_tokens=prompt,
            new_prompt_tokens=prompt,
            output_tokens=produced,
            attempts=(attempt,),
            decode_s=now - stream.arrival_s,
            rank_s=now - stream.arrival_s,
            first_token_s=times[0] if times else 0.0,
            token_times_s=times,
        )
        reason = FinishReason.ABORT if stream.aborted else FinishReason.LENGTH
        return RequestResult(request.request_id, tokens, reason, bill, self.rank, prefill_rank)

    async def _push(self, frontend: str, batch: StreamBatch) -> None:
        """The batch on the frontend's channel, as a decode rank's outbox sends it; waits while
        the channel holds back bytes, so the frontend's reading paces the steps."""
        connection = self._channels.connection(frontend) if self._channels is not None else None
        self._pushes += 1
        if connection is not None:
            connection.send(batch)
            while connection.buffered_bytes:
                await asyncio.sleep(0.0002)
                connection.flush()
        await asyncio.sleep(0)  # let submits and aborts in between steps


def _no_submit(items: list[Any]) -> None:
    raise ValueError("a fake prefill rank takes its jobs as actor calls, as a prefill rank does")


@ray.remote(num_cpus=0)
class FakePrefillRank:
    """A prefill rank that computes nothing and caches what it is sent (the module's docstring).

    A job's pages are the cache's only while it is "computed": matched, new ones allocated (the
    least recently used evictable ones first when none is free), its full pages cached, and all
    freed at once, as after its KV transfer; so every page is evictable between calls. A
    threaded actor of one thread, and a lock its channels' threads take too: calls and
    subscribes run one at a time, as on a rank's loop thread, so no event falls between a
    subscriber's snapshot and its next batch."""

    def __init__(self, rank: RankId, num_pages: int = FAKE_PREFILL_PAGES, page_size: int = PAGE_SIZE) -> None:
        self.rank = rank
        self.page_size = page_size
        self.cache = PrefixCache(PageAllocator(num_pages), page_size)
        self.kv_events = KVEventPublisher(rank, page_size, INCARNATION)
        self._lock = threading.Lock()
        self._channels = ChannelServer(
            ray.util.get_node_ip_address(), _no_submit, lambda ids: None, self._subscribe
        )
        self.outbox = ChannelOutbox(self._channels)
        self._jobs = self._batches = self._stored = self._removed = 0

    def channel_endpoint(self) -> Endpoint:
        """A channel server as a prefill rank's: frontends subscribe to its KV events on it."""
        return self._channels.endpoint()

    def _subscribe(self, subscriber: str) -> KVEventBatch:
        with self._lock:
            return self.kv_events.subscribe(subscriber, self.cache.cached_block_hashes())

    def submit(self, jobs: list[PrefillJob]) -> None:
        with self._lock:
            for job in jobs:
                self._prefill(job.prompt_token_ids, job.cache_salt)
                self._jobs += 1
            self._publish()

    def _prefill(self, prompt: tuple[int, ...], cache_salt: str | None) -> None:
        page_ids, _ = self.cache.match_prefix(prompt, cache_salt)
        matched = len(page_ids)
        fresh = self.cache.allocate(-(-len(prompt) // self.page_size) - matched)
        if fresh is None:  # longer than the whole pool: computed, not cached
            self.cache.free(page_ids)
            return
        page_ids += fresh
        self.cache.cache_full_pages(prompt, page_ids, len(prompt), matched, cache_salt)
        self.cache.free(page_ids)

    def _publish(self) -> None:
        """Each subscriber's batch of the cache's events, as ``prefill/worker.py`` ``publish``."""
        events = self.cache.take_events()
        for event in events:
            if isinstance(event, BlockStored):
                self._stored += len(event.block_hashes)
            elif isinstance(event, BlockRemoved):
                self._removed += len(event.block_hashes)
        for subscriber, batch in self.kv_events.publish(events).items():
            if self.outbox.push_kv_events(subscriber, batch):
                self._batches += 1
            else:
                self.kv_events.unsubscribe(subscriber)

    def stats(self) -> RankStats:
        cache = self.cache
        return RankStats(
            self.rank,
            Role.PREFILL,
            incarnation=INCARNATION,
            free_pages=cache.num_free_pages,
            total_pages=cache.num_total_pages,
            cached_pages=cache.num_cached_pages,
            prefix_queried_tokens=cache.num_queried_tokens,
            prefix_hit_tokens=cache.num_hit_tokens,
        )

    def check_integrity(self) -> None:
        self.cache.check_integrity()

    def counts(self) -> FakePrefillCounts:
        return FakePrefillCounts(self._jobs, self._batches, self._stored, self._removed)


@ray.remote(num_cpus=0)
class FakeController:
    """The controller's side of a frontend's life: the routing view, and its registration."""

    def __init__(
        self, prefill: dict[RankId, Any], decode: dict[RankId, Any], page_size: int = PAGE_SIZE
    ) -> None:
        groups = (
            GroupView("prefill0", Role.PREFILL, GroupState.READY, INCARNATION, tuple(sorted(prefill))),
            GroupView("decode0", Role.DECODE, GroupState.READY, INCARNATION, tuple(sorted(decode))),
        )
        capacity = FAKE_TOTAL_PAGES * page_size
        self._view = RoutingView(prefill, decode, groups, page_size, capacity, capacity)
        self.frontends: dict[str, FrontendInfo] = {}

    async def routing_view(self) -> RoutingView:
        return self._view

    async def register_frontend(self, info: FrontendInfo) -> None:
        self.frontends[info.name] = info

    async def unregister_frontend(self, name: str) -> None:
        self.frontends.pop(name, None)
