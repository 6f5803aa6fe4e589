"""The frontend: an async Ray actor that hosts the gRPC server, tokenises, routes and streams.

::

    Generate ─▶ validate (grpc_service) ─▶ route (router/) ─▶ decode rank.submit_requests
                                                                   │ one StreamBatch a step
    client ◀── chunks + summary ◀── RequestStream ◀── push_stream ◀┘
    prefill ranks ── push_kv_events ─▶ the router's block-hash index

A refresh task asks the controller for the ranks that take work (``routing_view``), subscribes
to every new prefill rank's KV events, reads the decode ranks' free pages for the router, ends
the streams of ranks whose group failed, and keeps the health service in step: SERVING only
while both pools have a rank that takes work and every prefill rank's index is loaded.

Invariant: a stream is in ``streams`` from admission until its generator ends; when it ends
before the ranks reported the end (client cancel, deadline) the decode rank is told to abort,
which frees its pages and the prefill rank's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

import ray

from tandem.cluster.cluster import CONTROLLER_NAME, RoutingView
from tandem.cluster.frontend_status import StatusView, read_status
from tandem.cluster.kv_event_feed import KVEventFeed
from tandem.cluster.request_stream import RequestStream, Route, StreamChunk, StreamSummary
from tandem.decode.worker import StreamBatch
from tandem.engine.dep_rank import RankRequest
from tandem.engine.prefix_cache import block_hashes
from tandem.engine.request import InvalidRequestError, SamplingParams
from tandem.engine.scheduler import max_kv_pages
from tandem.prefill.kv_events import KVEventBatch
from tandem.router.router import NoRankAvailable, Router

log = logging.getLogger(__name__)


async def _abort_after(submit: Any, running: _Running) -> None:
    """Abort once the submit has landed (an abort that overtook it would find nothing)."""
    with contextlib.suppress(ray.exceptions.RayError):
        await submit
    running.send_abort()


def _last_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__


FRONTEND_NAME = "tandem-frontend"


@dataclass(frozen=True)
class FrontendConfig:
    model_dir: str
    model_name: str
    host: str = "127.0.0.1"
    port: int = 50051  # 0: any free port
    max_running_requests: int = 256
    auth_token: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    refresh_s: float = 0.2
    controller: str = CONTROLLER_NAME
    name: str = FRONTEND_NAME


@dataclass(frozen=True)
class GenerateSpec:
    """A validated request (the servicer builds it from the protobuf)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_unix_s: float = field(default_factory=time.time)  # when the call reached the server


class FrontendUnavailable(Exception):
    """No pool is ready to take the request (UNAVAILABLE)."""


class FrontendOverloaded(Exception):
    """The frontend runs as many requests as it may (RESOURCE_EXHAUSTED)."""


class DuplicateRequest(Exception):
    """A running request has this id (ALREADY_EXISTS)."""


@dataclass
class _Running:
    """A request from admission to the end of its stream. ``rank_request_id`` is the id the
    ranks know it by: the client's id plus a unique suffix, so that a client may reuse an id the
    moment its stream ends while the ranks still wind the old one down."""

    stream: RequestStream
    rank_request_id: str
    decode_rank: str
    decode_key: tuple[str, int]  # (rank, incarnation) it was sent to
    handle: Any  # the decode rank's actor
    submitting: bool = True
    abort_requested: bool = False

    def send_abort(self) -> None:
        with contextlib.suppress(ray.exceptions.RayError):
            self.handle.abort.remote([self.rank_request_id])


class FrontendCore:
    """Everything but the gRPC server: tokenizer, router, streams, rank handles."""

    def __init__(self, config: FrontendConfig) -> None:
        from tandem.model.config import ModelConfig
        from tandem.model.tokenizer import Tokenizer

        self.config = config
        self.model_config = ModelConfig.from_dir(config.model_dir)
        self.tokenizer = Tokenizer.from_dir(config.model_dir)
        self.router = Router()
        self.view: RoutingView | None = None
        self.running: dict[str, _Running] = {}  # by the client's request id
        self._by_rank_id: dict[str, _Running] = {}  # by the ranks' request id
        self.ready = False
        self._incarnations: dict[str, int] = {}  # rank -> incarnation in the current view
        self.kv_events = KVEventFeed(self.router, config.name)
        self._tasks: set[asyncio.Future[None]] = set()

    # ---- requests -------------------------------------------------------------------------
    def new_request_id(self) -> str:
        return uuid.uuid4().hex

    async def generate(self, spec: GenerateSpec) -> AsyncGenerator[StreamChunk | StreamSummary, None]:
        view = self.view
        if not self.ready or view is None:
            raise FrontendUnavailable("the cluster is not ready: no prefill or no decode rank takes work")
        if spec.request_id in self.running:
            raise DuplicateRequest(f"request_id: {spec.request_id!r} is already running")
        if len(self.running) >= self.config.max_running_requests:
            raise FrontendOverloaded(
                f"{len(self.running)} requests are running, the most this frontend takes "
                f"(max_running_requests={self.config.max_running_requests}); retry later"
            )
        prompt = spec.prompt_token_ids
        self._check_capacity(view, len(prompt), spec.sampling.max_tokens)
        stream = RequestStream(spec.request_id, len(prompt), self.tokenizer, spec.arrival_unix_s)
        rank_request_id = f"{spec.request_id}@{uuid.uuid4().hex[:12]}"
        routed_at = time.time()
        try:
            decision = self.router.route(
                rank_request_id,
                block_hashes(prompt, view.page_size),
                len(prompt),
                view.page_size,
                spec.sampling.max_tokens,
            )
        except NoRankAvailable as exc:
            raise FrontendUnavailable(str(exc)) from None
        stream.route = Route(
            decision.prefill_rank,
            decision.decode_rank,
            decision.predicted_cached_tokens,
            decision.branch,
            queue_s=routed_at - stream.arrival_unix_s,
            routing_s=time.time() - routed_at,
        )
        rank = decision.decode_rank
        key = (rank, self._incarnations.get(rank, -1))
        running = _Running(stream, rank_request_id, rank, key, view.decode[rank])
        self.running[spec.request_id] = self._by_rank_id[rank_request_id] = running
        request = RankRequest(rank_request_id, prompt, spec.sampling, decision.prefill_rank, self.config.name)
        submit = running.handle.submit_requests.remote([request])
        try:
            try:
                await asyncio.shield(submit)  # a cancel here leaves the submit to finish first
            except ray.exceptions.RayError as exc:
                stream.fail(f"decode rank {rank} did not take the request: {_last_line(exc)}", rank)
            running.submitting = False
            if running.abort_requested and not stream.finished:
                running.send_abort()  # an Abort that came while the submit was on its way
            while True:
                item = await stream.queue.get()
                yield item
                if isinstance(item, StreamSummary):
                    return
        finally:
            if not stream.finished:  # the client cancelled, or its deadline passed
                stream.finished = True
                if running.submitting:
                    self._tasks.add(task := asyncio.ensure_future(_abort_after(submit, running)))
                    task.add_done_callback(self._tasks.discard)
                else:
                    running.send_abort()
            self.router.finished(rank_request_id)
            self.running.pop(spec.request_id, None)
            self._by_rank_id.pop(rank_request_id, None)

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

    def abort(self, request_id: str) -> bool:
        """Abort a running request (by the client's id); its stream ends when the rank reports
        the abort. False when no such request runs here."""
        running = self.running.get(request_id)
        if running is None:
            return False
        running.abort_requested = True
        if not running.submitting:
            running.send_abort()
        return True

    def on_stream(self, batch: StreamBatch) -> None:
        for delta in batch.deltas:
            running = self._by_rank_id.get(delta.request_id)
            if running is not None:
                if delta.start_index == 0:
                    self.router.prefill_done(delta.request_id)
                running.stream.on_delta(delta)
        for result in batch.finished:
            running = self._by_rank_id.get(result.request_id)
            if running is not None and not running.stream.finished:
                self.router.prefill_done(result.request_id)
                running.stream.on_result(result)

    def fail_rank(self, rank: str, why: str) -> None:
        """End every stream a decode rank held: it is gone and will report nothing."""
        for running in list(self.running.values()):
            if running.decode_rank == rank and not running.stream.finished:
                running.stream.fail(why, rank)

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
        self.router.set_ranks(sorted(view.prefill), sorted(view.decode))
        self.kv_events.keep_only(set(view.prefill))
        for rank, handle in view.prefill.items():
            if self.kv_events.needs_subscription(rank, incarnations[rank]):
                self._tasks.add(
                    task := asyncio.ensure_future(self.kv_events.subscribe(rank, incarnations[rank], handle))
                )
                task.add_done_callback(self._tasks.discard)
        await self._read_decode_stats(view)
        # a stream whose decode rank went down (failed group, or rebuilt under it) never ends
        # by itself: end it here
        for running in list(self.running.values()):
            rank, incarnation = running.decode_key
            gone = (
                states.get(rank) in ("failed", "stopped")
                or incarnations.get(rank, incarnation) != incarnation
            )
            if gone and not running.stream.finished:
                running.stream.fail(f"decode rank {rank} failed while serving the request", rank)
        # routing to a prefill rank whose index is still loading costs cache hits, not tokens
        self.ready = (
            bool(view.prefill)
            and bool(view.decode)
            and bool(self.kv_events.following.keys() & view.prefill.keys())
        )

    async def _read_decode_stats(self, view: RoutingView) -> None:
        names = sorted(view.decode)
        replies = await asyncio.gather(
            *[view.decode[n].stats.remote() for n in names], return_exceptions=True
        )
        for name, stats in zip(names, replies, strict=True):
            if isinstance(stats, ray.exceptions.RayActorError):
                self.fail_rank(name, f"decode rank {name} died while serving the request")
            elif isinstance(stats, dict):
                running = stats["running"] + stats["waiting_for_kv"]
                self.router.update_decode_stats(name, stats["free_pages"], running, stats["total_pages"])

    async def status(self, check_integrity: bool) -> StatusView:
        return await read_status(
            self.view, self.router, self.config.model_name, self.ready, len(self.running), check_integrity
        )


@ray.remote(num_cpus=0)
class Frontend:
    """The gRPC server as a named async Ray actor; ranks push streams and KV events to it."""

    def __init__(self, config: FrontendConfig) -> None:
        self.config = config
        self.core = FrontendCore(config)
        self._server: Any = None
        self._health: Any = None
        self._tasks: list[asyncio.Task[None]] = []
        self._serving: bool | None = None
        self.port = 0

    async def start(self) -> int:
        """Bind the port and start serving (NOT_SERVING until the pools are ready); the port."""
        from tandem.cluster.grpc_service import build_server

        self._server, self._health, self.port = build_server(self.core)
        await self._server.start()
        await self._set_health(False)
        self._tasks.append(asyncio.create_task(self._refresh_loop()))
        return self.port

    async def wait_ready(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.core.ready and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.core.ready

    async def push_stream(self, batch: StreamBatch) -> None:
        self.core.on_stream(batch)

    async def push_kv_events(self, batch: KVEventBatch) -> None:
        self.core.on_kv_events(batch)

    async def stop(self, grace_s: float = 2.0) -> None:
        for task in self._tasks:
            task.cancel()
        view = self.core.view
        if view is not None:  # the prefill ranks stop pushing KV events here
            for handle in view.prefill.values():
                with contextlib.suppress(ray.exceptions.RayError):
                    handle.unsubscribe_kv_events.remote(self.config.name)
        if self._server is not None:
            await self._set_health(False)
            await self._server.stop(grace_s)

    async def _refresh_loop(self) -> None:
        controller: Any = None
        while True:
            try:
                if controller is None:  # the frontend may start before the controller
                    try:
                        controller = ray.get_actor(self.config.controller)
                    except ValueError:
                        self.core.ready = False
                if controller is not None:
                    await self.core.refresh(controller)
            except ray.exceptions.RayError as exc:
                log.warning("refresh failed: %s", _last_line(exc))
                self.core.ready, controller = False, None
            except Exception:  # keep refreshing; never leave health SERVING on a frozen view
                log.exception("refresh failed")
                self.core.ready = False
            await self._set_health(self.core.ready)
            await asyncio.sleep(self.config.refresh_s)

    async def _set_health(self, serving: bool) -> None:
        if serving == self._serving:
            return
        from tandem.cluster.grpc_service import set_serving

        await set_serving(self._health, serving)
        self._serving = serving
