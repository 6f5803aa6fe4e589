"""The frontend's core: everything but the gRPC server and the actor around it. It tokenises,
routes and streams; the gRPC service (``grpc_service``) and ``tandem generate`` on a cluster
both call :meth:`FrontendCore.generate`, so every request takes this one path.

::

    Generate ─▶ validate (grpc_service) ─▶ route (router/) ─▶ decode rank.submit
                                                                   │ one StreamBatch a step
    client ◀── chunks + summary ◀── RequestStream ◀── push_stream ◀┘
    prefill ranks ── push_kv_events ─▶ the router's block-hash index

A refresh task asks the controller for the ranks that take work (``routing_view``), subscribes
to every new prefill rank's KV events, reads the decode ranks' free pages for the router, ends
the streams of ranks whose group failed, and keeps the health service in step: SERVING only
while both pools have a rank that takes work and every prefill rank's index is loaded.

Invariant: a stream is in ``running`` from admission until its generator ends; when it ends
before the ranks reported the end (client cancel, deadline) the decode rank is told to abort,
which frees its pages and the prefill rank's. Tokens pushed for a request no stream here waits
for (a frontend that restarted has lost its streams) get that request aborted the same way.

Request ids are the client's: ``running`` is keyed by :class:`RequestKey` (the authenticated
client and its id), so two clients may use one id and ``abort`` reaches only the caller's
request. The ranks know a request by an id of the frontend's own making (``_Running``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import ray

from tandem.cluster.controller import CONTROLLER_NAME, RoutingView
from tandem.engine.messages import Bill, RankId, RankRequest, RankStats, RequestResult, StreamBatch
from tandem.engine.prefix_cache import block_hashes
from tandem.engine.rank_loop import RankDraining
from tandem.engine.request import FinishReason, InvalidRequestError, SamplingParams
from tandem.engine.scheduler import max_kv_pages
from tandem.frontend.detokenizer import PairCache
from tandem.frontend.grpc_auth import ANONYMOUS, ClientToken, parse_client_tokens
from tandem.frontend.kv_event_feed import KVEventFeed
from tandem.frontend.limits import EdgeLimits
from tandem.frontend.rank_channel import RankChannel, SubmitRefused
from tandem.frontend.request_stream import RequestStream, Route, StreamChunk, StreamSummary
from tandem.frontend.status import StatusView, read_status
from tandem.metrics.frontend import FrontendMetrics
from tandem.metrics.labels import FrontendLabels
from tandem.model.config import ModelConfig
from tandem.model.tokenizer import Tokenizer
from tandem.prefill.kv_events import KVEventBatch
from tandem.router.router import NoRankAvailable, Router, RouterConfig

log = logging.getLogger(__name__)


# what a submit's answer raises: an actor call's error, a refusal or a lost connection (the socket)
SUBMIT_ERRORS = (ray.exceptions.RayError, SubmitRefused, ConnectionError)


def refusal(error: Exception) -> tuple[bool, str]:
    """Whether a decode rank refused a submit because it is being drained, and why it refused."""
    if isinstance(error, SubmitRefused):
        return error.draining, str(error)
    cause = getattr(error, "cause", None)
    if isinstance(cause, RankDraining):
        return True, str(cause)
    return False, last_line(error)


async def _abort_after(submit: Any, running: _Running) -> None:
    """Abort once the submit has landed (an abort that overtook it would find nothing)."""
    with contextlib.suppress(*SUBMIT_ERRORS):
        await submit
    running.send_abort()


def last_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__


FRONTEND_NAME = "tandem-frontend"
_DRAIN_RETRIES = 3  # submits to a rank that is being drained before the request fails


@dataclass(frozen=True)
class FrontendConfig:
    model_dir: str
    model_name: str
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port
    max_running_requests: int = 256
    max_migrations: int = 3  # times one request may move to another decode rank (its own failed)
    # how long a request whose decode rank failed waits for one to resume on (its own group
    # rebuilt, where the deployment has no other) before it ends with the error
    migration_wait_s: float = 60.0
    # a token file's text: one token, or ``name:token`` lines of several clients (``grpc_auth``)
    auth_token: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    refresh_s: float = 0.2
    controller: str = CONTROLLER_NAME
    name: str = FRONTEND_NAME
    metrics: bool = True  # keep Prometheus metrics (served when ``metrics_port`` is set)
    metrics_host: str = "127.0.0.1"
    metrics_port: int | None = None  # /metrics and /sd; 0: a free port
    limits: EdgeLimits = field(default_factory=EdgeLimits)
    cores: tuple[int, ...] | None = None  # the node's cores its process is pinned to (None: any)

    @property
    def clients(self) -> tuple[ClientToken, ...]:
        """Every client with its token (none: the server takes calls without a token)."""
        return parse_client_tokens(self.auth_token, "auth_token") if self.auth_token else ()


@dataclass(frozen=True)
class GenerateSpec:
    """A validated request (the servicer builds it from the protobuf)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_s: float = field(default_factory=time.monotonic)  # reached the server, this process's clock
    client: str = ANONYMOUS  # whose request id it is (``grpc_auth``)


@dataclass(frozen=True)
class RequestKey:
    """A running request as its client names it."""

    client: str
    request_id: str


@dataclass(frozen=True)
class StreamBuffer:
    """What a running request's stream holds for its client now (see ``RequestStream``)."""

    key: RequestKey
    items: int
    tokens: int


class FrontendUnavailable(Exception):
    """No pool is ready to take the request (UNAVAILABLE)."""


class FrontendOverloaded(Exception):
    """The frontend, or the client, runs as many requests as it may (RESOURCE_EXHAUSTED)."""


class DuplicateRequest(Exception):
    """A running request has this id (ALREADY_EXISTS)."""


@dataclass
class _Running:
    """A request from admission to the end of its stream. ``rank_request_id`` is the id the
    ranks know it by: the client's id plus a unique suffix, so that a client may reuse an id the
    moment its stream ends while the ranks still wind the old one down."""

    stream: RequestStream
    rank_request_id: str
    decode_rank: RankId
    incarnation: int  # of the decode rank it was sent to
    handle: Any  # the decode rank's actor
    spec: GenerateSpec | None = None  # as the client sent it (a migration resumes from it)
    submitting: bool = True
    abort_requested: bool = False
    # its decode rank failed and no other took it yet: waits for one until then (monotonic)
    parked_until: float | None = None
    parked_why: str = ""
    lost: tuple[str, int] = ("", -1)  # the group and incarnation it was lost with

    def send_abort(self) -> None:
        with contextlib.suppress(ray.exceptions.RayError):
            self.handle.abort.remote([self.rank_request_id])


class FrontendCore:
    """Everything but the gRPC server: tokenizer, router, streams, rank handles."""

    def __init__(self, config: FrontendConfig) -> None:
        self.config = config
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.tokenizer = Tokenizer.from_dir(config.model_dir)
        self.detokenizer_cache = PairCache(self.tokenizer)  # every stream's token pairs
        self.router = Router(RouterConfig(tie_break_salt=config.name))
        self.view: RoutingView | None = None
        self.running: dict[RequestKey, _Running] = {}  # by the client's request id
        self._per_client: dict[str, int] = {}  # running requests of each client
        self._by_rank_id: dict[str, _Running] = {}  # by the ranks' request id
        self.ready = False
        self.orphans_aborted = 0  # requests a decode rank streamed that no stream here waited for
        self._incarnations: dict[RankId, int] = {}  # rank -> incarnation in the current view
        self._rank_ids: dict[str, RankId] = {}  # the router's rank names -> the ranks
        self.kv_events = KVEventFeed(self.router, config.name)
        # each decode rank's submit socket, by (rank, incarnation); those that offer none
        self._channels: dict[tuple[RankId, int], RankChannel] = {}
        self._no_channel: set[tuple[RankId, int]] = set()
        self._opening: set[tuple[RankId, int]] = set()
        self.submits = {"socket": 0, "actor": 0}  # submits made each way
        self._tasks: set[asyncio.Future[None]] = set()
        self.metrics: FrontendMetrics | None = None
        if config.metrics:
            labels = FrontendLabels(config.model_name, config.name)
            self.metrics = FrontendMetrics(labels, streams_open=lambda: len(self.running))

    # ---- requests -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return uuid.uuid4().hex

    async def generate(self, spec: GenerateSpec) -> AsyncGenerator[StreamChunk | StreamSummary, None]:
        view = self.view
        if not self.ready or view is None:
            raise FrontendUnavailable("the cluster is not ready: no prefill or no decode rank takes work")
        key = RequestKey(spec.client, spec.request_id)
        if key in self.running:
            raise DuplicateRequest(f"request_id: {spec.request_id!r} is already running")
        if len(self.running) >= self.config.max_running_requests:
            raise FrontendOverloaded(
                f"{len(self.running)} requests are running, the most this frontend takes "
                f"(max_running_requests={self.config.max_running_requests}); retry later"
            )
        per_client, mine = self.config.limits.max_requests_per_client, self._per_client.get(spec.client, 0)
        if per_client is not None and mine >= per_client:
            raise FrontendOverloaded(
                f"this client runs {mine} requests, the most one client may "
                f"(max_requests_per_client={per_client}); retry later"
            )
        prompt = spec.prompt_token_ids
        self._check_capacity(view, len(prompt), spec.sampling.max_tokens)
        if spec.sampling.seed is None:  # drawn once: every rank and every attempt use it
            spec = dataclasses.replace(spec, sampling=spec.sampling.seeded())
        stream = RequestStream(
            spec.request_id,
            len(prompt),
            self.tokenizer,
            spec.arrival_s,
            detokenizer_cache=self.detokenizer_cache,
            stream_interval=self.config.limits.stream_interval,
            seed=spec.sampling.seed,
        )
        running, submit = self._route_and_submit(spec, stream, view)
        self._per_client[spec.client] = self._per_client.get(spec.client, 0) + 1
        try:
            for retry in range(1, _DRAIN_RETRIES + 1):
                try:
                    await asyncio.shield(submit)  # a cancel here leaves the submit to finish first
                    break
                except SUBMIT_ERRORS as exc:
                    draining, why = refusal(exc)
                    if not draining or retry == _DRAIN_RETRIES or running.abort_requested:
                        rank = running.decode_rank
                        stream.fail(f"decode rank {rank} did not take the request: {why}", rank)
                        break
                # the rank is being drained and the view that chose it is stale: route again on
                # the next one (the rank never held the request)
                self.router.finished(running.rank_request_id)
                self._by_rank_id.pop(running.rank_request_id, None)
                await asyncio.sleep(2 * self.config.refresh_s)
                if self.view is None:
                    raise FrontendUnavailable("the cluster is not ready")
                running, submit = self._route_and_submit(spec, stream, self.view)
            running.submitting = False
            if running.abort_requested and not stream.finished:
                running.send_abort()  # an Abort that came while the submit was on its way
            while True:
                item = await stream.buffer.get()  # all the tokens that came: one message
                if isinstance(item, StreamSummary) and self.metrics is not None:
                    self.metrics.ended(item)
                yield item
                if isinstance(item, StreamSummary):
                    return
        finally:
            if not stream.finished:  # the client cancelled, or its deadline passed
                stream.finished = True
                if self.metrics is not None:
                    self.metrics.rejected("CANCELLED", finish_reason="abort")
                if running.submitting:
                    self._tasks.add(task := asyncio.ensure_future(_abort_after(submit, running)))
                    task.add_done_callback(self._tasks.discard)
                else:
                    running.send_abort()
            self.router.finished(running.rank_request_id)
            self.running.pop(key, None)
            self._by_rank_id.pop(running.rank_request_id, None)
            if self._per_client[spec.client] > 1:
                self._per_client[spec.client] -= 1
            else:
                del self._per_client[spec.client]

    def _route_and_submit(
        self, spec: GenerateSpec, stream: RequestStream, view: RoutingView
    ) -> tuple[_Running, Any]:
        """Route the request over ``view``, record it as running and send it to its decode rank;
        the record and the submit call."""
        prompt = spec.prompt_token_ids
        rank_request_id = f"{spec.request_id}@{uuid.uuid4().hex[:12]}"
        routed_at = time.monotonic()
        try:
            decision = self.router.route(
                rank_request_id,
                block_hashes(prompt, view.page_size),
                len(prompt),
                view.page_size,
                spec.sampling.max_tokens,
                same_rank=view.colocated,
            )
        except NoRankAvailable as exc:
            raise FrontendUnavailable(str(exc)) from None
        routed_s = time.monotonic() - routed_at
        if self.metrics is not None:
            self.metrics.routed(decision.branch, decision.predicted_cached_tokens)
        rank, prefill_rank = self._rank_ids[decision.decode_rank], self._rank_ids[decision.prefill_rank]
        stream.route = Route(
            prefill_rank,
            rank,
            decision.predicted_cached_tokens,
            decision.branch,
            queue_s=routed_at - stream.arrival_s,
            routing_s=routed_s,
        )
        running = _Running(
            stream, rank_request_id, rank, self._incarnations.get(rank, -1), view.decode[rank], spec
        )
        self.running[RequestKey(spec.client, spec.request_id)] = self._by_rank_id[rank_request_id] = running
        request = RankRequest(rank_request_id, tuple(prompt), spec.sampling, prefill_rank, self.config.name)
        return running, self._submit(running, [request])

    def _submit(self, running: _Running, requests: list[RankRequest]) -> Any:
        """Send ``requests`` to ``running``'s decode rank: over its submit socket once open, as an
        actor call until then; the awaitable of the rank's answer (``SUBMIT_ERRORS``)."""
        channel = self._channels.get((running.decode_rank, running.incarnation))
        if channel is not None and channel.is_open:
            self.submits["socket"] += 1
            return channel.submit(requests)
        self.submits["actor"] += 1
        return running.handle.submit.remote(requests)

    def _check_capacity(self, view: RoutingView, prompt_tokens: int, max_tokens: int) -> None:
        """A request no rank could ever hold is refused here, naming the field to change."""
        if prompt_tokens > view.prefill_capacity_tokens:
            raise InvalidRequestError(
                "prompt",
                f"{prompt_tokens} tokens exceed a prefill rank's KV pool of {view.prefill_capacity_tokens}",
            )
        size = view.page_size
        pages = max_kv_pages(prompt_tokens, max_tokens, self.model_config.max_position_embeddings, size)
        if pages * size > view.decode_capacity_tokens:
            raise InvalidRequestError(
                "sampling.max_tokens",
                f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) need more KV than a "
                f"decode rank holds ({view.decode_capacity_tokens} tokens); lower max_tokens",
            )

    def abort(self, request_id: str, client: str = ANONYMOUS) -> bool:
        """Abort a running request of ``client`` (by its id); its stream ends when the rank
        reports the abort. False when the client runs no such request here."""
        running = self.running.get(RequestKey(client, request_id))
        if running is None:
            return False
        running.abort_requested = True
        if running.parked_until is not None:  # no rank holds it: it ends here
            running.parked_until = None
            running.stream.on_result(
                RequestResult(
                    running.rank_request_id, tuple(running.stream.tokens), FinishReason.ABORT, Bill()
                )
            )
        elif not running.submitting:
            running.send_abort()
        return True

    def on_stream(self, batch: StreamBatch) -> None:
        orphans: list[str] = []
        by_id, tokens, times, unix = self._by_rank_id, batch.token_ids, batch.times_s, batch.times_unix_s
        begin = 0
        for request_id, start, end in zip(batch.request_ids, batch.start_indices, batch.ends, strict=True):
            running = by_id.get(request_id)
            if running is None:
                orphans.append(request_id)
            else:
                if start == 0:
                    self.router.prefill_done(request_id)
                if end - begin == 1:
                    running.stream.on_token(start, tokens[begin], times[begin], unix[begin])
                else:
                    running.stream.on_tokens(start, tokens[begin:end], times[begin:end], unix[begin:end])
            begin = end
        if orphans:
            self._abort_orphans(batch.decode_rank, orphans)
        for result in batch.finished:
            running = self._by_rank_id.get(result.request_id)
            if running is not None and not running.stream.finished:
                self.router.prefill_done(result.request_id)
                if result.rank_failure is not None:  # the rank failed, not the request: move it
                    self._rank_lost(running, result.rank_failure)
                else:
                    running.stream.on_result(result)

    def _abort_orphans(self, rank: RankId, request_ids: list[str]) -> None:
        """Tokens of requests no stream here waits for (this frontend restarted and lost them,
        or their client went away): the decode rank is told to abort them, which frees their
        pages there and on their prefill rank. Ids are registered before a request is
        submitted, so no live request is taken for an orphan."""
        handle = self.view.decode.get(rank) if self.view is not None else None
        if handle is None:
            return
        with contextlib.suppress(ray.exceptions.RayError):
            handle.abort.remote(sorted(set(request_ids)))
        self.orphans_aborted += len(set(request_ids))

    def stream_buffers(self) -> list[StreamBuffer]:
        """Every running request's buffered items (a chunk and the summary at most)."""
        return [
            StreamBuffer(key, len(r.stream.buffer), r.stream.buffer.tokens) for key, r in self.running.items()
        ]

    def fail_rank(self, rank: RankId, why: str) -> None:
        """Every stream a decode rank held (it is gone and will report nothing) resumes on a
        decode rank of another group, or waits for one (its own group rebuilt) and ends with
        ``why`` if none comes in time."""
        for running in list(self.running.values()):
            if running.decode_rank == rank and not running.stream.finished:
                self._rank_lost(running, why)

    def _rank_lost(self, running: _Running, why: str) -> None:
        """Resume the request on a decode rank of another group; where none takes work, it
        waits ``migration_wait_s`` for one (its own group rebuilt) before it ends with ``why``."""
        if running.parked_until is not None or self._resume_elsewhere(running, running.decode_rank.group_id):
            return
        running.lost = (running.decode_rank.group_id, running.incarnation)
        may_wait = (
            running.spec is not None
            and not running.abort_requested
            and not running.submitting
            and running.stream.migrations < self.config.max_migrations
            and self.config.migration_wait_s > 0
        )
        if not may_wait:
            running.stream.fail(why, running.decode_rank)
            return
        running.parked_until, running.parked_why = time.monotonic() + self.config.migration_wait_s, why
        self.router.finished(running.rank_request_id)  # no rank holds it while it waits

    def _resume_parked(self) -> None:
        """Requests waiting for a decode rank: resumed on one of the view's (a rebuilt group's
        too), or ended once they have waited ``migration_wait_s``."""
        now = time.monotonic()
        for running in list(self.running.values()):
            if running.parked_until is None or running.stream.finished:
                continue
            # on any rank but the failed incarnation's (the view may list it a while longer)
            if self._resume_elsewhere(running, *running.lost):
                running.parked_until = None
            elif now >= running.parked_until:
                running.parked_until = None
                running.stream.fail(running.parked_why, running.decode_rank)

    def _resume_elsewhere(self, running: _Running, failed_group: str, incarnation: int | None = None) -> bool:
        """Move a request whose decode rank failed to a decode rank of another group: it resumes
        there from its prompt and the tokens its client already has (the prefill rank recomputes
        their KV, or finds it cached), its stream goes on from the next token, and seeded or
        greedy sampling gives the tokens an undisturbed run would. False (nothing changed) when
        the request may not move again, was being aborted, or no other group takes work."""
        spec, view, stream = running.spec, self.view, running.stream
        if spec is None or view is None or running.abort_requested or running.submitting:
            return False
        if stream.migrations >= self.config.max_migrations:
            return False
        ids, incarnations = self._rank_ids, self._incarnations

        def excluded(rank: RankId) -> bool:  # the failed group (at that incarnation, if given)
            return rank.group_id == failed_group and incarnation in (None, incarnations.get(rank))

        left = [r for r in self.router.decode_ranks if r in ids and not excluded(ids[r])]
        tokens = stream.tokens
        if not left or len(tokens) >= spec.sampling.max_tokens:
            return False
        # until the next view drops it (a colocated rank is a prefill rank too)
        self.router.set_ranks(left if view.colocated else self.router.prefill_ranks, left)
        self.router.finished(running.rank_request_id)
        self._by_rank_id.pop(running.rank_request_id, None)
        resumed = [*spec.prompt_token_ids, *tokens]
        rank_request_id = f"{spec.request_id}@{uuid.uuid4().hex[:12]}"
        try:
            decision = self.router.route(
                rank_request_id,
                block_hashes(resumed, view.page_size),
                len(resumed),
                view.page_size,
                spec.sampling.max_tokens - len(tokens),
                same_rank=view.colocated,
            )
        except NoRankAvailable:
            return False
        rank, prefill_rank = self._rank_ids[decision.decode_rank], self._rank_ids[decision.prefill_rank]
        running.rank_request_id, running.decode_rank = rank_request_id, rank
        running.incarnation, running.handle = self._incarnations.get(rank, -1), view.decode[rank]
        self._by_rank_id[rank_request_id] = running
        stream.migrated()
        if self.metrics is not None:
            self.metrics.migrations.inc()
        request = RankRequest(
            rank_request_id,
            tuple(spec.prompt_token_ids),
            spec.sampling,
            prefill_rank,
            self.config.name,
            resume_output_ids=tuple(tokens),
        )
        submit = self._submit(running, [request])
        self._tasks.add(task := asyncio.ensure_future(self._resumed(submit, running, rank)))
        task.add_done_callback(self._tasks.discard)
        log.warning("request %s moved to decode rank %s after %d tokens", spec.request_id, rank, len(tokens))
        return True

    async def _resumed(self, submit: Any, running: _Running, rank: RankId) -> None:
        """A resumed request the new decode rank refuses ends with its error."""
        try:
            await submit
        except SUBMIT_ERRORS as exc:
            if running.decode_rank == rank and not running.stream.finished:
                running.stream.fail(
                    f"decode rank {rank} did not take the resumed request: {refusal(exc)[1]}", rank
                )

    def on_kv_events(self, batch: KVEventBatch) -> None:
        self.kv_events.on_batch(batch)

    # ---- membership -----------------------------------------------------------------------
    async def refresh(self, controller: Any) -> None:
        """One look at the controller's view: ranks to route over, KV subscriptions to start
        (in the background: a busy rank answers late), decode ranks' free pages, and the streams
        of decode ranks that went down."""
        view: RoutingView = await controller.routing_view.remote()
        incarnations = {rank: g.incarnation for g in view.groups for rank in g.ranks}
        states = {rank: g.state for g in view.groups for rank in g.ranks}
        self.view, self._incarnations = view, incarnations
        self._rank_ids = {rank.name: rank for g in view.groups for rank in g.ranks}
        self.router.set_ranks(sorted(r.name for r in view.prefill), sorted(r.name for r in view.decode))
        self.kv_events.keep_only({r.name for r in view.prefill})
        for rank, handle in view.prefill.items():
            if self.kv_events.needs_subscription(rank.name, incarnations[rank]):
                subscribe = self.kv_events.subscribe(rank.name, incarnations[rank], handle)
                self._tasks.add(task := asyncio.ensure_future(subscribe))
                task.add_done_callback(self._tasks.discard)
        self._keep_channels(view, incarnations)
        await self._read_rank_stats(view)
        # a stream whose decode rank went down (failed group, or rebuilt under it) never ends
        # by itself: end it here
        for running in list(self.running.values()):
            rank, incarnation = running.decode_rank, running.incarnation
            gone = (
                states.get(rank) in ("failed", "stopped")
                or incarnations.get(rank, incarnation) != incarnation
            )
            if gone and not running.stream.finished:
                self._rank_lost(running, f"decode rank {rank} failed while serving the request")
        self._resume_parked()
        # routing to a prefill rank whose index is still loading costs cache hits, not tokens
        self.ready = (
            bool(view.prefill)
            and bool(view.decode)
            and bool(self.kv_events.following.keys() & {r.name for r in view.prefill})
        )

    def _keep_channels(self, view: RoutingView, incarnations: dict[RankId, int]) -> None:
        """A submit socket to every decode rank of the view (opened in the background: until it
        is, submits are actor calls); those that ended are dropped, and those of ranks that left
        the view once no submit waits on them (a rank being drained answers its last submits
        with a refusal, and their requests are routed again)."""
        current = {(rank, incarnations[rank]) for rank in view.decode}
        for key, channel in list(self._channels.items()):
            if not channel.is_open or (key not in current and not channel.waiting):
                self._channels.pop(key).close()
        self._no_channel &= current
        for key in current - self._channels.keys() - self._no_channel - self._opening:
            handle = view.decode[key[0]]
            if not hasattr(handle, "submit_endpoint"):
                self._no_channel.add(key)
                continue
            self._opening.add(key)
            self._tasks.add(task := asyncio.ensure_future(self._open_channel(key, handle)))
            task.add_done_callback(self._tasks.discard)

    async def _open_channel(self, key: tuple[RankId, int], handle: Any) -> None:
        try:
            channel = await RankChannel.open(await handle.submit_endpoint.remote())
        except (ray.exceptions.RayError, OSError, TimeoutError, TypeError, ValueError) as exc:
            # no route to it: actor calls it is (a rank that failed is rebuilt with a new key)
            log.info("decode rank %s: submits stay actor calls: %s", key[0], exc)
            self._no_channel.add(key)
            return
        finally:
            self._opening.discard(key)
        if self.view is not None and key[0] in self.view.decode and self._incarnations.get(key[0]) == key[1]:
            self._channels[key] = channel
        else:  # the rank left the view meanwhile
            channel.close()

    def open_channels(self) -> int:
        return sum(channel.is_open for channel in self._channels.values())

    def close_channels(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    async def _read_rank_stats(self, view: RoutingView) -> None:
        """Every rank's report: decode ranks' free pages and requests, prefill ranks' pending
        tokens (loads that include the other frontends' requests)."""
        handles = view.decode | view.prefill
        ranks = sorted(handles)
        replies = await asyncio.gather(*[handles[r].stats.remote() for r in ranks], return_exceptions=True)
        for rank, stats in zip(ranks, replies, strict=True):
            if isinstance(stats, ray.exceptions.RayActorError) and rank in view.decode:
                self.fail_rank(rank, f"decode rank {rank} died while serving the request")
            elif isinstance(stats, RankStats) and rank in view.decode:
                running = stats.running + stats.waiting_for_kv
                self.router.update_decode_stats(rank.name, stats.free_pages, running, stats.total_pages)
            elif isinstance(stats, RankStats):
                self.router.update_prefill_stats(rank.name, stats.pending_tokens)

    async def status(self, check_integrity: bool) -> StatusView:
        return await read_status(
            self.view, self.router, self.config.model_name, self.ready, len(self.running), check_integrity
        )
