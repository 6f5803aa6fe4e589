"""The gRPC edge: protobuf in, validated dataclasses to :class:`FrontendCore`, protobuf out.

Status codes: a bad field -> INVALID_ARGUMENT naming it (``sampling.top_p: must be in (0, 1]``);
a running request id -> ALREADY_EXISTS; the frontend, or the client, at its limit of running
requests -> RESOURCE_EXHAUSTED; no pool ready -> UNAVAILABLE; a missing or wrong bearer token ->
UNAUTHENTICATED (``grpc_auth``). The server also carries ``grpc.health.v1`` and server reflection
(``v1`` and ``v1alpha``: ``grpc_standard_services``).

Every size a client controls is capped here, before any work is done on it: the request's bytes
(``limits.max_request_bytes``, gRPC's RESOURCE_EXHAUSTED), the text's characters and the prompt's
tokens (within the model's context), ``sampling.max_tokens`` (the context minus the prompt),
``sampling.stop_token_ids`` (``request_checks.MAX_STOP_TOKEN_IDS`` at most, each in the vocabulary) and the
request id (:data:`REQUEST_ID`). Bytes that do not parse, and fields this server does not know
(a newer client's: silently ignoring, say, a sampling option would change what the client gets),
are INVALID_ARGUMENT too; no client input ends a call with INTERNAL or UNKNOWN. Values echoed in an
error are cut short, so that no status outgrows gRPC's metadata limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import unknown_fields
from google.protobuf.message import DecodeError, Message
from grpc_health.v1 import health_pb2

from tandem.frontend.cache_salt import check_cache_salt
from tandem.frontend.core import FrontendCore
from tandem.frontend.grpc_auth import ANONYMOUS, BearerAuth, BearerTokenInterceptor, server_credentials
from tandem.frontend.grpc_standard_services import add_health, add_reflection
from tandem.frontend.request_checks import check_ids_fit, check_text_fits, checked_sampling, stop_token_ids
from tandem.frontend.request_stream import StreamChunk
from tandem.frontend.running import GenerateSpec
from tandem.frontend.status import StatusView
from tandem.protos import tandem_pb2, tandem_pb2_grpc
from tandem.wire.logprobs import TokenLogprobs
from tandem.wire.messages import CachedByTier, PrefillAttempt, ProcessPlace, RankId, RankStats
from tandem.wire.request_params import Guide, GuideKind, InvalidRequestError, SamplingParams, check_prompt
from tandem.wire.stream_summary import StreamSummary

SERVICE_NAME = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"].full_name
MAX_REQUEST_ID_CHARS = 128
REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=-]*")  # what a request id may hold (uuids, base64, paths)
INLINE_TOKENIZE_CHARS = 16384
SHOWN_CHARS = 64  # of a client's value quoted in an error


def build_server(core: FrontendCore) -> tuple[Any, Any, int]:
    """An unstarted ``grpc.aio`` server with the Tandem, health and reflection services; the
    server, its health servicer and the bound port."""
    config = core.config
    config.limits.check()
    auth = BearerAuth(config.clients) if config.clients else None
    interceptors = [BearerTokenInterceptor(auth)] if auth is not None else []
    # no SO_REUSEPORT: a second server on a taken port must fail, not share its clients
    options = [("grpc.so_reuseport", 0), *config.limits.server_options()]
    server = grpc.aio.server(interceptors=interceptors, options=options)
    _add_tandem_service(TandemServicer(core, auth), server)
    health_servicer = add_health(server)
    add_reflection(server, (SERVICE_NAME,))
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


@dataclass(frozen=True)
class Unparsable:
    """What the service's deserializer hands on for bytes that are not its request message."""

    why: str


def _parser(message_type: type[Message]) -> Any:
    def parse(data: bytes) -> Message | Unparsable:
        try:
            return message_type.FromString(data)
        except DecodeError as exc:
            return Unparsable(str(exc))

    return parse


def _add_tandem_service(servicer: TandemServicer, server: Any) -> None:
    """``add_TandemServicer_to_server`` with deserializers that never raise: gRPC would end a
    call whose bytes do not parse with UNKNOWN, the servicer ends it with INVALID_ARGUMENT."""
    methods = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"].methods_by_name
    handlers = {}
    for name, method in methods.items():
        request_type = getattr(tandem_pb2, method.input_type.name)
        response_type = getattr(tandem_pb2, method.output_type.name)
        make = (
            grpc.unary_stream_rpc_method_handler
            if method.server_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        handlers[name] = make(
            getattr(servicer, name),
            request_deserializer=_parser(request_type),
            response_serializer=response_type.SerializeToString,
        )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    server.add_registered_method_handlers(SERVICE_NAME, handlers)


def unknown_field_paths(message: Message, prefix: str = "") -> list[str]:
    """Where ``message`` holds fields its schema does not declare: ``sampling.#15`` is field
    number 15 of ``sampling``, at any depth."""
    paths = [f"{prefix}#{f.field_number}" for f in unknown_fields.UnknownFieldSet(message)]
    for descriptor, value in message.ListFields():
        if descriptor.message_type is None:
            continue
        entry = descriptor.message_type
        if entry.GetOptions().map_entry:  # a map: its values, when they are messages
            children = list(value.values()) if entry.fields_by_name["value"].message_type else []
        else:
            children = list(value) if descriptor.is_repeated else [value]
        for child in children:
            paths += unknown_field_paths(child, f"{prefix}{descriptor.name}.")
    return paths


def _shown(value: str) -> str:
    """``value`` quoted, cut short."""
    return (
        repr(value) if len(value) <= SHOWN_CHARS else f"{value[:SHOWN_CHARS]!r}... ({len(value)} characters)"
    )


class TandemServicer(tandem_pb2_grpc.TandemServicer):
    def __init__(self, core: FrontendCore, auth: BearerAuth | None = None) -> None:
        self.core = core
        self.auth = auth

    async def _checked(self, request: Message | Unparsable, context: grpc.aio.ServicerContext) -> Any:
        """The request, if it parsed and holds only known fields; else the call ends."""
        if isinstance(request, Unparsable):
            await self._refuse(
                context, grpc.StatusCode.INVALID_ARGUMENT, InvalidRequestError("request", request.why)
            )
        unknown = unknown_field_paths(request)
        if unknown:
            shown = ", ".join(unknown[:8]) + (f" and {len(unknown) - 8} more" if len(unknown) > 8 else "")
            why = f"unknown fields {shown}: this server does not know them (a newer client?)"
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, InvalidRequestError("request", why))
        return request

    def _client(self, context: grpc.aio.ServicerContext) -> str:
        """Whose call this is: the client of its bearer token (the interceptor let only known
        ones through), or the one anonymous client without auth."""
        if self.auth is None:
            return ANONYMOUS
        client = self.auth.client_of(context.invocation_metadata())
        assert client is not None, "the bearer-token interceptor lets no unknown token through"
        return client

    async def Generate(
        self, request: tandem_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[tandem_pb2.GenerateResponse]:
        from tandem.frontend.core import DuplicateRequest, FrontendOverloaded, FrontendUnavailable

        arrival_s = time.monotonic()
        request = await self._checked(request, context)
        try:
            spec = await self._spec(request, arrival_s, self._client(context))
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
            self.core.metrics.rejected(code.name, client=self._client(context))
        await context.abort(code, str(exc))

    async def Abort(
        self, request: tandem_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> tandem_pb2.AbortResponse:
        request = await self._checked(request, context)
        try:
            _check_request_id(request.request_id)
        except InvalidRequestError as exc:
            await self._refuse(context, grpc.StatusCode.INVALID_ARGUMENT, exc)
        return tandem_pb2.AbortResponse(found=self.core.abort(request.request_id, self._client(context)))

    async def ClusterStatus(
        self, request: tandem_pb2.ClusterStatusRequest, context: grpc.aio.ServicerContext
    ) -> tandem_pb2.ClusterStatusResponse:
        request = await self._checked(request, context)
        view = await self.core.status(request.check_integrity)
        if self.auth is not None and not self.core.is_admin(client := self._client(context)):
            # a client's usage (its cached tokens above all) is its own business
            view = dataclasses.replace(view, clients=tuple(u for u in view.clients if u.client == client))
        return _status(view)

    # ---- validation -----------------------------------------------------------------------
    async def _spec(self, request: tandem_pb2.GenerateRequest, arrival_s: float, client: str) -> GenerateSpec:
        core = self.core
        if request.request_id:
            _check_request_id(request.request_id)
        request_id = request.request_id or core.new_request_id()
        if request.model and request.model != core.config.model_name:
            raise InvalidRequestError(
                "model",
                f"unknown model {_shown(request.model)}; this server serves {core.config.model_name!r}",
            )
        which = request.WhichOneof("prompt")
        cfg = core.model_config
        context = cfg.max_position_embeddings
        if which == "text":
            if not request.text:
                raise InvalidRequestError("text", "is empty")
            check_text_fits("text", len(request.text), context)
            if len(request.text) > INLINE_TOKENIZE_CHARS:  # keep the event loop for the streams
                prompt = await asyncio.to_thread(core.tokenizer.encode, request.text)
            else:
                prompt = core.tokenizer.encode(request.text)
            field = "text"
        elif which == "token_ids":
            field = "token_ids"
            check_ids_fit(field, len(request.token_ids.ids), context)
            prompt = list(request.token_ids.ids)
        else:
            raise InvalidRequestError("prompt", "expected text or token_ids")
        if not prompt:
            raise InvalidRequestError(field, "is empty")
        sampling = sampling_from_proto(
            request.sampling if request.HasField("sampling") else None, cfg.vocab_size
        )
        if sampling.guide is not None:  # compiled on the compiler's thread: a bad spec is refused
            await core.check_guide(sampling.guide, guide_field(request.sampling))
        try:
            check_prompt(prompt, cfg.vocab_size, context, field=field)
        except InvalidRequestError as exc:  # named by this API's field, whichever check failed
            raise InvalidRequestError(field, str(exc).split(": ", 1)[1]) from None
        if sampling.max_tokens > context - len(prompt):
            raise InvalidRequestError(
                "sampling.max_tokens",
                f"{sampling.max_tokens} with a prompt of {len(prompt)} tokens passes the context of "
                f"{context} tokens: at most {context - len(prompt)}",
            )
        salt = check_cache_salt(request.cache_salt) if request.HasField("cache_salt") else None
        return GenerateSpec(request_id, prompt, sampling, arrival_s, client, cache_salt=salt)


def _check_request_id(request_id: str) -> None:
    if len(request_id) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError("request_id", f"longer than {MAX_REQUEST_ID_CHARS} characters")
    if not request_id:
        raise InvalidRequestError("request_id", "is empty")
    valid = REQUEST_ID.match(request_id)
    assert valid is not None  # the pattern matches the empty prefix
    if valid.end() < len(request_id):
        at = valid.end()
        raise InvalidRequestError(
            "request_id",
            f"character {request_id[at]!r} at {at} is not one of A-Z a-z 0-9 . _ : / + = -",
        )


def sampling_from_proto(message: tandem_pb2.SamplingParams | None, vocab_size: int) -> SamplingParams:
    if message is None:
        raise InvalidRequestError("sampling", "is missing (sampling.max_tokens is required)")
    stops = stop_token_ids("sampling.stop_token_ids", message.stop_token_ids, vocab_size)
    sampling = SamplingParams(
        max_tokens=message.max_tokens,
        temperature=float(message.temperature),
        top_p=float(message.top_p) if message.HasField("top_p") else 1.0,
        top_k=message.top_k,
        seed=message.seed if message.HasField("seed") else None,
        stop_token_ids=stops,
        ignore_eos=message.ignore_eos,
        presence_penalty=float(message.presence_penalty),
        frequency_penalty=float(message.frequency_penalty),
        repetition_penalty=float(message.repetition_penalty)
        if message.HasField("repetition_penalty")
        else 1.0,
        min_p=float(message.min_p),
        logprobs=message.logprobs if message.HasField("logprobs") else None,
        prompt_logprobs=message.prompt_logprobs if message.HasField("prompt_logprobs") else None,
        logit_bias=tuple(sorted(message.logit_bias.items())),
        guide=_guide_from_proto(message),
    )
    return checked_sampling(sampling, "sampling.", vocab_size)


def _guide_from_proto(message: tandem_pb2.SamplingParams) -> Guide | None:
    which = message.WhichOneof("structure")
    if which is None or (which == "json_object" and not message.json_object):
        return None
    if which == "json_object":
        return Guide(GuideKind.JSON_OBJECT)
    return Guide(GuideKind(which), getattr(message, which))


def guide_field(message: tandem_pb2.SamplingParams) -> str:
    """The field a request's guide came from, as its errors name it."""
    return f"sampling.{message.WhichOneof('structure')}"


# ---- protobuf out ---------------------------------------------------------------------------
def _latency(item: StreamSummary) -> tandem_pb2.Latency:
    """The bill's latency composition: the frontend's parts (its route), then the ranks'."""
    bill, route = item.bill, item.route
    return tandem_pb2.Latency(
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


def _attempt(a: PrefillAttempt) -> tandem_pb2.Attempt:
    """One attempt of the bill: its prefill rank, tokens, bytes and times."""
    return tandem_pb2.Attempt(
        attempt=a.attempt,
        prefill_rank=_name(a.prefill_rank),
        delivered=a.delivered,
        error=a.error or "",
        prompt_tokens=a.prompt_tokens,
        cached_tokens=a.cached_tokens,
        cached_tokens_by_tier=_by_tier(a.cached_by_tier),
        kv_bytes=a.kv_bytes,
        kv_wait_s=a.kv_wait_s,
        kv_accept_s=a.kv_accept_s,
        prefill_pickup_s=a.prefill_pickup_s,
        prefill_queue_s=a.prefill_queue_s,
        prefill_compute_s=a.prefill_compute_s,
        kv_transfer_s=a.kv_transfer_s,
        kv_transfer_exposed_s=a.kv_transfer_exposed_s,
    )


def _response(request_id: str, item: StreamChunk | StreamSummary) -> tandem_pb2.GenerateResponse:
    if isinstance(item, StreamChunk):  # columns in, columns out: no object per token
        response = tandem_pb2.GenerateResponse(request_id=request_id)
        chunk = response.chunk
        chunk.token_ids.extend(item.token_ids)
        chunk.text = item.text
        chunk.first_index = item.first_index
        chunk.server_times_s.extend(item.server_times_s)
        chunk.gaps_s.extend(item.gaps_s)
        if item.logprobs is not None:
            chunk.logprobs.extend(_logprob(t, e) for t, e in zip(item.token_ids, item.logprobs, strict=True))
        return response
    bill, route = item.bill, item.route
    latency, attempts = _latency(item), [_attempt(a) for a in bill.attempts]
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
            migrations=bill.migrations,
            seed=bill.seed,
            speculation=tandem_pb2.Speculation(
                draft_tokens=bill.speculation.draft_tokens,
                accepted_tokens=bill.speculation.accepted_tokens,
                steps=bill.speculation.steps,
                acceptance_length=bill.speculation.acceptance_length,
            ),
            cached_tokens_by_tier=_by_tier(bill.cached_tokens_by_tier),
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
        prompt_logprobs=[_logprob(e.token_id, e) for e in item.prompt_logprobs[1:] if e is not None],
    )
    return tandem_pb2.GenerateResponse(request_id=request_id, summary=summary)


def _logprob(token_id: int, entry: TokenLogprobs | None) -> tandem_pb2.TokenLogprob:
    """A token's logprobs (NaN where none came: an output resumed from a failed rank)."""
    if entry is None:
        return tandem_pb2.TokenLogprob(token_id=token_id, logprob=float("nan"))
    return tandem_pb2.TokenLogprob(
        token_id=token_id,
        logprob=entry.logprob,
        top_token_ids=[t for t, _ in entry.top],
        top_logprobs=[lp for _, lp in entry.top],
    )


def _name(rank: RankId | None) -> str:
    return rank.name if rank else ""


def _by_tier(cached: CachedByTier) -> tandem_pb2.CachedTokensByTier:
    return tandem_pb2.CachedTokensByTier(device=cached.device, host=cached.host, store=cached.store)


def _rank_counts(s: RankStats | None) -> dict[str, Any]:
    """A rank's figures as ``RankStatus`` fields (none before its first report)."""
    if s is None:
        return {}
    return {
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
        "kv_cache_usage_ratio": (s.total_pages - s.free_pages) / s.total_pages if s.total_pages else 0.0,
        "sends_in_flight": s.sends_in_flight,
        "receives_in_flight": s.receives_in_flight,
        "kv_bytes_sent": s.kv_bytes_sent,
        "kv_bytes_received": s.kv_bytes_received,
        "prefix_queried_tokens": s.prefix_queried_tokens,
        "prefix_hit_tokens": s.prefix_hit_tokens,
        "preemptions": s.preemptions,
        "weight_bytes": s.weight_bytes,
        "transfer_failures": {f"{d}/{c}": n for d, c, n in s.transfer_failures},
        "steps": s.loop.steps,
        "step_s": s.loop.step_s,
    }


def _status(view: StatusView) -> tandem_pb2.ClusterStatusResponse:
    groups = []
    for g in view.groups:
        ranks = []
        for r in g.ranks:
            counts = _rank_counts(r.stats)
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
        clients=[tandem_pb2.ClientUsage(**vars(u)) for u in view.clients],
    )


def _place(place: ProcessPlace | None) -> tandem_pb2.ProcessPlace | None:
    if place is None:
        return None
    return tandem_pb2.ProcessPlace(
        node_id=place.node_id, node_address=place.node_address, node_labels=dict(place.labels), pid=place.pid
    )
