"""The gRPC edge: protobuf in, validated dataclasses to :class:`FrontendCore`, protobuf out.

Status codes: a bad field -> INVALID_ARGUMENT naming it (``sampling.top_p: must be in (0, 1]``);
a running request id -> ALREADY_EXISTS; the frontend full -> RESOURCE_EXHAUSTED; no pool ready
-> UNAVAILABLE; a missing or wrong bearer token -> UNAUTHENTICATED (``grpc_auth``). The server
also carries ``grpc.health.v1`` and server reflection.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tandem.engine.messages import ProcessPlace, RankId
from tandem.engine.request import InvalidRequestError, SamplingParams, check_prompt
from tandem.frontend.core import FrontendCore, GenerateSpec
from tandem.frontend.grpc_auth import BearerTokenInterceptor, server_credentials
from tandem.frontend.request_stream import StreamChunk, StreamSummary
from tandem.frontend.status import StatusView
from tandem.protos import tandem_pb2, tandem_pb2_grpc

SERVICE_NAME = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name
MAX_REQUEST_ID_CHARS = 128
INLINE_TOKENIZE_CHARS = 16384


def build_server(core: FrontendCore) -> tuple[Any, Any, int]:
    """An unstarted ``grpc.aio`` server with the Tandem, health and reflection services; the
    server, its health servicer and the bound port."""
    config = core.config
    interceptors = [BearerTokenInterceptor(config.auth_token)] if config.auth_token else []
    # no SO_REUSEPORT: a second server on a taken port must fail, not share its clients
    server = grpc.aio.server(interceptors=interceptors, options=[("grpc.so_reuseport", 0)])
    tandem_pb2_grpc.add_TandemServicer_to_server(TandemServicer(core), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection((SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), server)
    address = f"{config.host}:{config.port}"
    if config.tls_cert_file or config.tls_key_file:
        if not (config.tls_cert_file and config.tls_key_file):
            raise ValueError("tls_cert_file and tls_key_file go together")
        port = server.add_secure_port(address, server_credentials(config.tls_cert_file, config.tls_key_file))
    else:
        port = server.add_insecure_port(address)
    if port == 0:
        raise OSError(f"cannot bind {address}")
    return server, health_servicer, port


async def set_serving(health_servicer: Any, serving: bool) -> None:
    status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, status)


class TandemServicer(tandem_pb2_grpc.TandemServicer):
    def __init__(self, core: FrontendCore) -> None:
        self.core = core

    async def Generate(
        self, request: tandem_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tandem_pb2.GenerateResponse]:
        from tandem.frontend.core import DuplicateRequest, FrontendOverloaded, FrontendUnavailable

        arrival_s = time.monotonic()
        try:
            spec = await self._spec(request, arrival_s)
        except InvalidRequestError as exc:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        try:
            async with contextlib.aclosing(self.core.generate(spec)) as items:
                async for item in items:
                    yield _response(spec.request_id, item)
        except FrontendOverloaded as exc:
            await self._refuse(context, grpc.StatusCode.RESOURCE_EXHAUSTED, exc)
        except FrontendUnavailable as exc:
            await self._refuse(context, grpc.StatusCode.UNAVAILABLE, exc)
        except DuplicateRequest as exc:
            await self._refuse(context, grpc.StatusCode.ALREADY_EXISTS, exc)
        except InvalidRequestError as exc:  # limits of the running pools
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, exc)

    async def _refuse(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, exc: Exception) -> None:
        if self.core.metrics is not None:
            self.core.metrics.rejected(code.name)
        await context.abort(code, str(exc))

    async def Abort(
        self, request: tandem_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> tandem_pb2.AbortResponse:
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id: is empty")
        return tandem_pb2.AbortResponse(found=self.core.abort(request.request_id))

    async def ClusterStatus(
        self, request: tandem_pb2.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> tandem_pb2.ClusterStatusResponse:
        return _status(await self.core.status(request.check_integrity))

    # ---- validation -----------------------------------------------------------------------
    async def _spec(self, request: tandem_pb2.GenerateRequest, arrival_s: float) -> GenerateSpec:
        core = self.core
        request_id = request.request_id or core.new_request_id()
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise InvalidRequestError("request_id", f"longer than {MAX_REQUEST_ID_CHARS} characters")
        if not request_id.isprintable():
            raise InvalidRequestError("request_id", "must be printable")
        if request.model and request.model != core.config.model_name:
            raise InvalidRequestError(
                "model", f"unknown model {request.model!r}; this server serves {core.config.model_name!r}"
            )
        which = request.WhichOneof("prompt")
        cfg = core.model_config
        if which == "text":
            if not request.text:
                raise InvalidRequestError("text", "is empty")
            if len(request.text) > INLINE_TOKENIZE_CHARS:  # keep the event loop for the streams
                prompt = await asyncio.to_thread(core.tokenizer.encode, request.text)
            else:
                prompt = core.tokenizer.encode(request.text)
            field = "text"
        elif which == "token_ids":
            prompt = list(request.token_ids.ids)
            field = "token_ids"
        else:
            raise InvalidRequestError("prompt", "expected text or token_ids")
        if not prompt:
            raise InvalidRequestError(field, "is empty")
        sampling = _sampling(request.sampling if request.HasField("sampling") else None, cfg.vocab_size)
        try:
            check_prompt(prompt, cfg.vocab_size, cfg.max_position_embeddings, field=field)
        except InvalidRequestError as exc:  # named by this API's field, whichever check failed
            raise InvalidRequestError(field, str(exc).split(": ", 1)[1]) from None
        return GenerateSpec(request_id, prompt, sampling, arrival_s)


def _sampling(message: tandem_pb2.SamplingParams | None, vocab_size: int) -> SamplingParams:
    if message is None:
        raise InvalidRequestError("sampling", "is missing (sampling.max_tokens is required)")
    if not math.isfinite(message.temperature):
        raise InvalidRequestError("sampling.temperature", f"must be finite, got {message.temperature}")
    stops = tuple(message.stop_token_ids)
    bad = [t for t in stops if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(
            "sampling.stop_token_ids", f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})"
        )
    sampling = SamplingParams(
        max_tokens=message.max_tokens,
        temperature=float(message.temperature),
        top_p=float(message.top_p) if message.HasField("top_p") else 1.0,
        top_k=message.top_k,
        seed=message.seed if message.HasField("seed") else None,
        stop_token_ids=stops,
        ignore_eos=message.ignore_eos,
    )
    try:
        sampling.validate()
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"sampling.{exc.field}", str(exc).split(": ", 1)[1]) from None
    return sampling


# ---- protobuf out ---------------------------------------------------------------------------
def _response(request_id: str, item: StreamChunk | StreamSummary) -> tandem_pb2.GenerateResponse:
    if isinstance(item, StreamChunk):
        chunk = tandem_pb2.Chunk(
            token_ids=item.token_ids,
            text=item.text,
            timings=[
                tandem_pb2.TokenTiming(index=t.index, server_time_s=t.server_time_s, gap_s=t.gap_s)
                for t in item.timings
            ],
        )
        return tandem_pb2.GenerateResponse(request_id=request_id, chunk=chunk)
    bill, route = item.bill, item.route
    latency = tandem_pb2.Latency(
        queue_s=route.queue_s if route else 0.0,
        routing_s=route.routing_s if route else 0.0,
        pickup_s=bill.pickup_s,
        reservation_wait_s=bill.reservation_wait_s,
        kv_wait_s=bill.kv_wait_s,
        kv_accept_s=bill.kv_accept_s,
        decode_s=bill.decode_s,
        rank_s=bill.rank_s,
        prefill_pickup_s=bill.prefill_pickup_s,
        prefill_queue_s=bill.prefill_queue_s,
        prefill_compute_s=bill.prefill_compute_s,
        kv_transfer_s=bill.kv_transfer_s,
        kv_transfer_exposed_s=bill.kv_transfer_exposed_s,
        ttft_s=item.ttft_s,
        e2e_s=item.e2e_s,
    )
    attempts = [
        tandem_pb2.Attempt(
            attempt=a.attempt,
            prefill_rank=_name(a.prefill_rank),
            delivered=a.delivered,
            error=a.error or "",
            prompt_tokens=a.prompt_tokens,
            cached_tokens=a.cached_tokens,
            kv_bytes=a.kv_bytes,
            kv_wait_s=a.kv_wait_s,
            kv_accept_s=a.kv_accept_s,
            prefill_pickup_s=a.prefill_pickup_s,
            prefill_queue_s=a.prefill_queue_s,
            prefill_compute_s=a.prefill_compute_s,
            kv_transfer_s=a.kv_transfer_s,
            kv_transfer_exposed_s=a.kv_transfer_exposed_s,
        )
        for a in bill.attempts
    ]
    summary = tandem_pb2.Summary(
        finish_reason=item.finish_reason,
        error=item.error or "",
        bill=tandem_pb2.Bill(
            prompt_tokens=bill.prompt_tokens,
            cached_tokens=bill.cached_tokens,
            new_prompt_tokens=bill.new_prompt_tokens,
            output_tokens=len(item.token_ids),
            kv_bytes=bill.kv_bytes,
            latency=latency,
            attempts=attempts,
            preemptions=bill.preemptions,
        ),
        placement=tandem_pb2.Placement(
            prefill_group=item.prefill_rank.group_id if item.prefill_rank else "",
            prefill_rank=_name(item.prefill_rank),
            decode_group=item.decode_rank.group_id if item.decode_rank else "",
            decode_rank=_name(item.decode_rank),
            predicted_cached_tokens=route.predicted_cached_tokens if route else 0,
            route_branch=route.branch if route else "",
        ),
        token_ids=item.token_ids,
        text=item.text,
    )
    return tandem_pb2.GenerateResponse(request_id=request_id, summary=summary)


def _name(rank: RankId | None) -> str:
    return rank.name if rank else ""


def _status(view: StatusView) -> tandem_pb2.ClusterStatusResponse:
    groups = []
    for g in view.groups:
        ranks = []
        for r in g.ranks:
            s = r.stats
            counts: dict[str, Any] = (
                {
                    "queued": s.queued,
                    "running": s.running,
                    "waiting_for_kv": s.waiting_for_kv,
                    "computing": s.computing,
                    "transferring": s.transferring,
                    "free_pages": s.free_pages,
                    "total_pages": s.total_pages,
                    "cached_pages": s.cached_pages,
                    "transfers_in_flight": s.sends_in_flight + s.receives_in_flight,
                    "incarnation": s.incarnation,
                    "kv_cache_usage_ratio": (s.total_pages - s.free_pages) / s.total_pages
                    if s.total_pages
                    else 0.0,
                    "sends_in_flight": s.sends_in_flight,
                    "receives_in_flight": s.receives_in_flight,
                    "kv_bytes_sent": s.kv_bytes_sent,
                    "kv_bytes_received": s.kv_bytes_received,
                    "prefix_queried_tokens": s.prefix_queried_tokens,
                    "prefix_hit_tokens": s.prefix_hit_tokens,
                    "preemptions": s.preemptions,
                    "transfer_failures": {f"{d}/{c}": n for d, c, n in s.transfer_failures},
                    "steps": s.loop.steps,
                    "step_s": s.loop.step_s,
                }
                if s is not None
                else {}
            )
            ranks.append(
                tandem_pb2.RankStatus(
                    name=r.name,
                    role=r.role,
                    routed_prefill_tokens=r.routed_prefill_tokens,
                    routed_requests=r.routed_requests,
                    indexed_blocks=r.indexed_blocks,
                    integrity=r.integrity,
                    place=_place(r.place),
                    **counts,
                )
            )
        groups.append(
            tandem_pb2.GroupStatus(
                group_id=g.group_id,
                role=g.role,
                state=g.state,
                incarnation=g.incarnation,
                ranks=ranks,
                failure=g.failure or "",
                unplaceable=g.unplaceable,
            )
        )
    decisions = [
        tandem_pb2.AutoscalerDecision(
            unix_time=at,
            pool=d.pool,
            action=d.action,
            rule=d.rule,
            ready_groups=d.ready_groups,
            desired_groups=d.desired_groups,
            inputs_json=json.dumps(d.inputs, sort_keys=True),
        )
        for at, d in view.autoscaler_decisions
    ]
    return tandem_pb2.ClusterStatusResponse(
        model=view.model,
        ready=view.ready,
        groups=groups,
        router_counters=view.router_counters,
        running_requests=view.running_requests,
        autoscaler_decisions=decisions,
        deployment=view.deployment,
        controller=_place(view.controller),
        frontends=[
            tandem_pb2.FrontendStatus(
                name=f.name,
                address=f.address,
                metrics_address=f.metrics_target.address if f.metrics_target else "",
                place=_place(f.place),
            )
            for f in view.frontends
        ],
    )


def _place(place: ProcessPlace | None) -> tandem_pb2.ProcessPlace | None:
    if place is None:
        return None
    return tandem_pb2.ProcessPlace(
        node_id=place.node_id, node_address=place.node_address, node_labels=dict(place.labels), pid=place.pid
    )
