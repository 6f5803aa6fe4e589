"""The frontend's core: everything but the gRPC server and the actor around it. It tokenises,
admits, routes and streams; the gRPC service (``grpc_service``), the OpenAI edge and
``tandem generate`` on a cluster all call :meth:`FrontendCore.generate`, so every request takes
this one path.

::

    Generate ─▶ validate (edges) ─▶ admit ─▶ route (router/) ─▶ Submit on the decode rank's channel
                                                                   │ one StreamBatch a step, same channel
    client ◀── chunks + summary ◀── RequestStream ◀── on_stream ◀──┘
    prefill ranks ── KVEventBatch on their channels ─▶ the router's block-hash index

Its parts: ``membership.py`` (the controller's view, the ranks' loads and channels, read
every ``refresh_s``), ``migration.py`` (requests whose decode rank failed move to another), and
this file: admission, the one route-and-submit (``_send``, for a new request and a moved one),
streams, aborts. Health is SERVING only while both pools have a rank that takes work and a
prefill rank's index is loaded.

Invariant: a stream is in ``running`` from admission until its generator ends; when it ends
before the ranks reported the end (client cancel, deadline) the decode rank is told to abort,
which frees its pages and the prefill rank's. Tokens pushed for a request no stream here waits
for (a frontend that restarted has lost its streams) get that request aborted the same way.

Request ids are the client's: ``running`` is keyed by :class:`RequestKey` (the authenticated
client and its id), so two clients may use one id and ``abort`` reaches only the caller's
request. The ranks know a request by an id of the frontend's own making (``Running``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.frontend import grammar_checker
from tandem.frontend.cache_salt import chain_salt
from tandem.frontend.client_usage import UsageBook
from tandem.frontend.detokenizer import PairCache
from tandem.frontend.grammar_checker import GuideChecker
from tandem.frontend.grpc_auth import ANONYMOUS, ClientToken, parse_client_tokens
from tandem.frontend.kv_event_feed import KVEventFeed
from tandem.frontend.limits import EdgeLimits
from tandem.frontend.membership import Membership
from tandem.frontend.migration import Migration
from tandem.frontend.rank_channel import SUBMIT_ERRORS, RankNotReachable, refusal
from tandem.frontend.request_checks import check_capacity
from tandem.frontend.request_stream import RequestStream, StreamChunk
from tandem.frontend.running import GenerateSpec, RequestKey, Running
from tandem.frontend.status import StatusView, read_status
from tandem.metrics.frontend import FrontendMetrics
from tandem.metrics.http import MetricsSecurity
from tandem.metrics.labels import FrontendLabels
from tandem.model.family import read_config
from tandem.model.tokenizer import Tokenizer
from tandem.router.router import NoRankAvailable, Router, RouterConfig
from tandem.wire.block_chain import block_hashes
from tandem.wire.kv_events import KVEventBatch
from tandem.wire.messages import Bill, RankId, RankRequest, RequestResult, StreamBatch
from tandem.wire.request_params import FinishReason, Guide
from tandem.wire.routing_view import CONTROLLER_NAME, RoutingView
from tandem.wire.stream_summary import Route, StreamSummary

log = logging.getLogger(__name__)


async def _abort_after(submit: Any, running: Running) -> None:
    """Abort once the submit has landed (an abort that overtook it would find nothing)."""
    with contextlib.suppress(*SUBMIT_ERRORS):
        await submit
    running.send_abort()


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
    metrics_security: MetricsSecurity = field(default_factory=MetricsSecurity)  # token and TLS of them
    limits: EdgeLimits = field(default_factory=EdgeLimits)
    cores: tuple[int, ...] | None = None  # the node's cores its process is pinned to (None: any)

    @property
    def clients(self) -> tuple[ClientToken, ...]:
        """Every client with its token (none: the server takes calls without a token)."""
        return parse_client_tokens(self.auth_token, "auth_token") if self.auth_token else ()


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


class FrontendCore:
    """Everything but the gRPC server: tokenizer, router, streams, rank handles."""

    def __init__(self, config: FrontendConfig) -> None:
        self.config = config
        self.model_config = read_config(Path(config.model_dir))  # either family
        self.tokenizer = Tokenizer.from_dir(config.model_dir)
        self.detokenizer_cache = PairCache(self.tokenizer)  # every stream's token pairs
        self._grammar: GuideChecker | None = None  # structured outputs' checks, made at the first
        self._grammar_lock = threading.Lock()
        self.router: Router[RankId] = Router(RouterConfig(tie_break_salt=config.name))
        self.running: dict[RequestKey, Running] = {}  # by the client's request id
        self._per_client: dict[str, int] = {}  # running requests of each client
        self.usage = UsageBook([c.name for c in config.clients])  # each client's totals
        self._clients = {c.name: c for c in config.clients}
        self._by_rank_id: dict[str, Running] = {}  # by the ranks' request id
        self.ready = False
        self.orphans_aborted = 0  # requests a decode rank streamed that no stream here waited for
        self.kv_events = KVEventFeed(self.router)
        self._tasks: set[asyncio.Future[None]] = set()
        self.membership = Membership(
            self.router, self.kv_events, self._tasks, config.name, self.on_stream, self._channel_lost
        )
        self.metrics: FrontendMetrics | None = None
        if config.metrics:
            labels = FrontendLabels(config.model_name, config.name)
            self.metrics = FrontendMetrics(
                labels, streams_open=lambda: len(self.running), clients=[c.name for c in config.clients]
            )
        self.migration = Migration(
            self.router,
            self.membership,
            self._send,
            config.max_migrations,
            config.migration_wait_s,
            self.metrics,
            self._tasks,
        )

    async def check_guide(self, guide: Guide, field: str) -> None:
        """Compile a structured output's guide in the grammar checker's process (started at the
        first, on a thread: a frontend that serves none starts none; xgrammar imports torch,
        which this process never does), several specs at once, each once (cached); a spec that
        does not compile, or not within ``limits.grammar_compile_limit_s``, raises
        ``InvalidRequestError`` naming ``field``."""
        checker = self._grammar
        if checker is None:
            checker = await asyncio.to_thread(self._grammar_checker)
        await checker.check(guide, field)

    def _grammar_checker(self) -> GuideChecker:
        with self._grammar_lock:
            if self._grammar is None:
                limit_s = self.config.limits.grammar_compile_limit_s
                self._grammar = grammar_checker.start_checker(
                    self.config.model_dir, self.model_config.vocab_size, limit_s
                )
            return self._grammar

    @property
    def view(self) -> RoutingView | None:
        return self.membership.view

    # ---- requests -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return uuid.uuid4().hex

    async def generate(self, spec: GenerateSpec) -> AsyncGenerator[StreamChunk | StreamSummary, None]:
        view = self.view
        if not self.ready or view is None:
            raise FrontendUnavailable("the cluster is not ready: no prefill or no decode rank takes work")
        key = RequestKey(spec.client, spec.request_id)
        _check_room(self.config, key, self.running, self._per_client.get(spec.client, 0))
        prompt = spec.prompt_token_ids
        context = self.model_config.max_position_embeddings
        check_capacity(view, len(prompt), spec.sampling.max_tokens, context)
        if spec.sampling.guide is not None:  # the edges checked theirs (cached): this is for the rest
            await self.check_guide(spec.sampling.guide, "sampling.guide")
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
        running, submit = self._admit(spec, stream, view)
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
                running, submit = self._admit(spec, stream, self.view)
            running.submitting = False
            if running.abort_requested and not stream.finished:
                running.send_abort()  # an Abort that came while the submit was on its way
            wants_logprobs, first = spec.sampling.logprobs is not None, True
            while True:
                item = await stream.buffer.get()  # all the tokens that came: one message
                if isinstance(item, StreamSummary):
                    self.usage.add(spec.client, item)
                    if self.metrics is not None:
                        self.metrics.ended(item, client=spec.client)
                elif isinstance(item, StreamChunk):
                    if wants_logprobs:
                        item.logprobs = stream.logprobs_of(item.first_index, len(item.token_ids))
                    if first:
                        item.prompt_logprobs, first = stream.prompt_logprobs, False
                yield item
                if isinstance(item, StreamSummary):
                    return
        finally:
            if not stream.finished:  # the client cancelled, or its deadline passed
                stream.finished = True
                if self.metrics is not None:
                    self.metrics.rejected("CANCELLED", finish_reason="abort", client=spec.client)
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

    def _admit(self, spec: GenerateSpec, stream: RequestStream, view: RoutingView) -> tuple[Running, Any]:
        """Route a new request over ``view``, record it as running and submit it; the record
        and the submit's awaitable."""
        routed_at = time.monotonic()
        try:
            running, submit = self._send(None, (), spec, stream, view)
        except NoRankAvailable as exc:
            raise FrontendUnavailable(str(exc)) from None
        route = stream.route
        assert route is not None
        stream.route = dataclasses.replace(route, queue_s=routed_at - stream.arrival_s)
        self.running[running.key] = running
        return running, submit

    def _send(
        self,
        running: Running | None,
        resumed_from: tuple[int, ...],
        spec: GenerateSpec | None = None,
        stream: RequestStream | None = None,
        view: RoutingView | None = None,
    ) -> tuple[Running, Any]:
        """The one route-and-submit: choose a prefill and a decode rank for the request's prompt
        (and the outputs it resumes from, for a moved request), point its record at them under a
        new rank request id, and submit it. A new request (``running`` None) gets its record and
        its route; a moved one keeps its first route. ``NoRankAvailable`` when no rank takes it
        (nothing changed then)."""
        view = view or self.view
        spec = spec or (running.spec if running is not None else None)
        assert view is not None and spec is not None
        prompt = [*spec.prompt_token_ids, *resumed_from]
        rank_request_id = f"{spec.request_id}@{uuid.uuid4().hex[:12]}"
        routed_at = time.monotonic()
        salt = chain_salt(spec.cache_salt, self._clients.get(spec.client))
        hashes = block_hashes(prompt, view.page_size, salt)  # once, however many routes it takes
        parent = (
            self.running.get(RequestKey(spec.client, spec.fork_of))
            if spec.fork_of and running is None
            else None
        )
        for _ in range(len(view.decode) + 1):
            decision = self.router.route(
                rank_request_id,
                hashes,
                len(prompt),
                view.page_size,
                spec.sampling.max_tokens - len(resumed_from),
                same_rank=view.colocated,
                decode_rank=parent.decode_rank if parent is not None else None,
            )
            rank, prefill_rank = decision.decode_rank, decision.prefill_rank
            incarnation = self.membership.incarnations.get(rank, -1)
            try:
                channel = self.membership.channel(rank, incarnation)
                break
            except RankNotReachable:  # its channel ended since: route over the ranks left
                self.router.finished(rank_request_id)
                self.membership.route_over(view)
                parent = None
        else:
            raise NoRankAvailable("decode")
        routed_s = time.monotonic() - routed_at
        if running is None:
            assert stream is not None
            if self.metrics is not None:
                self.metrics.routed(decision.branch, decision.predicted_cached_tokens, len(prompt))
            stream.route = Route(
                prefill_rank, rank, decision.predicted_cached_tokens, decision.branch, 0.0, routed_s
            )
            running = Running(stream, rank_request_id, rank, incarnation, channel, spec)
        else:
            self._by_rank_id.pop(running.rank_request_id, None)
            running.rank_request_id, running.decode_rank = rank_request_id, rank
            running.incarnation, running.channel = incarnation, channel
        self._by_rank_id[rank_request_id] = running
        request = RankRequest(
            rank_request_id,
            tuple(spec.prompt_token_ids),
            spec.sampling,
            prefill_rank,
            self.config.name,
            resume_output_ids=resumed_from,
            fork_of=parent.rank_request_id if parent is not None and parent.decode_rank == rank else None,
            cache_salt=salt,
        )
        return running, self.membership.submit(channel, [request])

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
        for request_id, prompt_logprobs in batch.prompt_logprobs:
            running = by_id.get(request_id)
            if running is not None and not running.stream.prompt_logprobs:
                running.stream.prompt_logprobs = prompt_logprobs
        logprobs = batch.logprobs
        begin = 0
        for request_id, start, end in zip(batch.request_ids, batch.start_indices, batch.ends, strict=True):
            running = by_id.get(request_id)
            if running is None:
                orphans.append(request_id)
            else:
                if start == 0:
                    self.router.prefill_done(request_id)
                if logprobs:
                    running.stream.add_logprobs(start, logprobs[begin:end])
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
                    self.migration.rank_lost(running, result.rank_failure)
                else:
                    running.stream.on_result(result)

    def _abort_orphans(self, rank: RankId, request_ids: list[str]) -> None:
        """Tokens of requests no stream here waits for (this frontend restarted and lost them,
        or their client went away): the decode rank is told to abort them, which frees their
        pages there and on their prefill rank. Ids are registered before a request is
        submitted, so no live request is taken for an orphan."""
        self.membership.abort(rank, sorted(set(request_ids)))
        self.orphans_aborted += len(set(request_ids))

    def stream_buffers(self) -> list[StreamBuffer]:
        """Every running request's buffered items (a chunk and the summary at most)."""
        return [
            StreamBuffer(key, len(r.stream.buffer), r.stream.buffer.tokens) for key, r in self.running.items()
        ]

    def fail_rank(self, rank: RankId, why: str) -> None:
        """Every stream a decode rank held (it is gone and will report nothing) moves to
        another (``migration``)."""
        for running in list(self.running.values()):
            if running.decode_rank == rank and not running.stream.finished:
                self.migration.rank_lost(running, why)

    def _channel_lost(self, rank: RankId, incarnation: int, why: str) -> None:
        """The channel to a decode rank ended: the requests it carried move (their tokens would
        have come on it; the rank ends what it holds for this frontend). One being submitted
        is routed again by its submit's error."""
        for running in list(self.running.values()):
            if (
                (running.decode_rank, running.incarnation) == (rank, incarnation)
                and not running.stream.finished
                and not running.submitting
            ):
                self.migration.rank_lost(running, f"the channel to decode rank {rank} ended: {why}")

    def on_kv_events(self, batch: KVEventBatch) -> None:
        self.kv_events.on_batch(batch)

    async def refresh(self, controller: Any) -> None:
        """One look at the controller's view: ranks to route over (``membership``), their loads,
        and the streams of decode ranks that went down, which move (``migration``)."""
        view: RoutingView = await controller.routing_view.remote()
        self.membership.apply(view)
        for rank in await self.membership.read_rank_stats(view):
            self.fail_rank(rank, f"decode rank {rank} died while serving the request")
        # a stream whose decode rank went down (failed group, or rebuilt under it) never ends
        # by itself: it moves, or ends here
        for running in list(self.running.values()):
            gone = self.membership.gone(running.decode_rank, running.incarnation)
            if gone and not running.stream.finished:
                self.migration.rank_lost(
                    running, f"decode rank {running.decode_rank} failed while serving the request"
                )
        self.migration.resume_parked(list(self.running.values()))
        self.ready = self.membership.ready

    def is_admin(self, client: str) -> bool:
        """Whether the token file makes ``client`` an admin (it sees every client's usage)."""
        token = self._clients.get(client)
        return token is not None and token.admin

    async def status(self, check_integrity: bool) -> StatusView:
        view = await read_status(
            self.view, self.router, self.config.model_name, self.ready, len(self.running), check_integrity
        )
        return dataclasses.replace(view, clients=self.usage.totals())


def _check_room(
    config: FrontendConfig, key: RequestKey, running: Mapping[RequestKey, Any], mine: int
) -> None:
    """Room for one more request of ``key``'s client, which runs ``mine`` here already: its id
    not running, fewer than ``max_running_requests`` in all and than the client's cap."""
    if key in running:
        raise DuplicateRequest(f"request_id: {key.request_id!r} is already running")
    if len(running) >= config.max_running_requests:
        raise FrontendOverloaded(
            f"{len(running)} requests are running, the most this frontend takes "
            f"(max_running_requests={config.max_running_requests}); retry later"
        )
    per_client = config.limits.max_requests_per_client
    if per_client is not None and mine >= per_client:
        raise FrontendOverloaded(
            f"this client runs {mine} requests, the most one client may "
            f"(max_requests_per_client={per_client}); retry later"
        )
