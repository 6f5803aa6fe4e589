"""``tandem client``: a gRPC client of the frontend (no Ray, no torch).

``generate`` sends prompts with up to ``concurrency`` streams open at once, prints text as it
arrives (``--stream``) and each request's bill at the end; ``--json`` prints the object
``tandem generate --json`` prints, each output with its ``placement`` and ``bill`` added.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client.output import emit
from tandem.client.prompts import PromptSpec
from tandem.frontend.grpc_auth import channel_credentials
from tandem.protos import tandem_pb2, tandem_pb2_grpc
from tandem.wire.request_params import GuideKind


@dataclass(frozen=True)
class ClientOptions:
    addr: str
    token: str | None = None
    tls_ca_file: str | None = None
    tls: bool = False
    timeout_s: float | None = None


def message_dict(message: Any) -> dict[str, Any]:
    """A message as plain JSON values, every field present, integers as numbers (protobuf's own
    JSON mapping writes 64-bit integers as strings)."""
    out: dict[str, Any] = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[f.name] = dict(value)
        elif f.message_type is not None:
            out[f.name] = [message_dict(v) for v in value] if _repeated(f) else message_dict(value)
        else:
            out[f.name] = list(value) if _repeated(f) else value
    return out


def _repeated(f: Any) -> bool:
    return bool(f.is_repeated)


def channel(options: ClientOptions) -> grpc.aio.Channel:
    if options.tls or options.tls_ca_file:
        return grpc.aio.secure_channel(options.addr, channel_credentials(options.tls_ca_file))
    return grpc.aio.insecure_channel(options.addr)


def metadata(options: ClientOptions) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {options.token}"),) if options.token else ()


def request_message(spec: PromptSpec, request_id: str = "", model: str = "") -> tandem_pb2.GenerateRequest:
    s = spec.sampling
    sampling = tandem_pb2.SamplingParams(
        max_tokens=s.max_tokens,
        temperature=s.temperature,
        top_p=s.top_p,
        top_k=s.top_k,
        ignore_eos=s.ignore_eos,
        stop_token_ids=list(s.stop_token_ids),
        presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty,
        min_p=s.min_p,
    )
    if s.seed is not None:
        sampling.seed = s.seed
    if s.repetition_penalty != 1.0:
        sampling.repetition_penalty = s.repetition_penalty
    sampling.logit_bias.update(dict(s.logit_bias))
    if s.logprobs is not None:
        sampling.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        sampling.prompt_logprobs = s.prompt_logprobs
    if s.guide is not None:
        if s.guide.kind is GuideKind.JSON_OBJECT:
            sampling.json_object = True
        else:
            setattr(sampling, s.guide.kind.value, s.guide.spec)
    message = tandem_pb2.GenerateRequest(request_id=request_id, model=model, sampling=sampling)
    if spec.token_ids is not None:
        message.token_ids.ids.extend(spec.token_ids)
    else:
        message.text = spec.text or ""
    return message


@dataclass
class Outcome:
    """One request's stream as the client saw it."""

    index: int
    chunks: list[tandem_pb2.Chunk] = field(default_factory=list)
    summary: tandem_pb2.Summary | None = None

    def record(self) -> dict[str, Any]:
        """The ``tandem generate --json`` output object, plus ``placement`` and ``bill``."""
        summary = self.summary
        assert summary is not None
        return {
            "token_ids": list(summary.token_ids),
            "text": summary.text,
            "prompt_tokens": summary.bill.prompt_tokens,
            "cached_tokens": summary.bill.cached_tokens,
            "cached_tokens_by_tier": message_dict(summary.bill.cached_tokens_by_tier),
            "finish_reason": summary.finish_reason,
            "error": summary.error,
            "placement": message_dict(summary.placement),
            "bill": message_dict(summary.bill),
        }


async def generate_all(
    options: ClientOptions,
    specs: list[PromptSpec],
    concurrency: int,
    on_chunk: Any = None,
    model: str = "",
) -> list[Outcome]:
    """Run every prompt, at most ``concurrency`` at once; ``on_chunk(index, chunk)`` per chunk.
    A failed call raises its ``grpc.aio.AioRpcError``."""
    if concurrency < 1:
        raise ValueError(f"--concurrency: must be at least 1, got {concurrency}")
    gate = asyncio.Semaphore(concurrency)
    async with channel(options) as ch:
        stub = tandem_pb2_grpc.TandemStub(ch)

        async def one(index: int, spec: PromptSpec) -> Outcome:
            outcome = Outcome(index)
            async with gate:
                call = stub.Generate(
                    request_message(spec, model=model), metadata=metadata(options), timeout=options.timeout_s
                )
                async for response in call:
                    if response.HasField("chunk"):
                        outcome.chunks.append(response.chunk)
                        if on_chunk is not None:
                            on_chunk(index, response.chunk)
                    else:
                        outcome.summary = response.summary
            return outcome

        return list(await asyncio.gather(*[one(i, s) for i, s in enumerate(specs)]))


async def status(options: ClientOptions, check_integrity: bool = False) -> tandem_pb2.ClusterStatusResponse:
    async with channel(options) as ch:
        stub = tandem_pb2_grpc.TandemStub(ch)
        request = tandem_pb2.ClusterStatusRequest(check_integrity=check_integrity)
        response: tandem_pb2.ClusterStatusResponse = await stub.ClusterStatus(
            request, metadata=metadata(options), timeout=options.timeout_s
        )
        return response


async def client_totals(
    options: ClientOptions, reply: tandem_pb2.ClusterStatusResponse
) -> tuple[list[dict[str, Any]], list[str], list[str]]:
    """Each client's totals over every frontend of the deployment (each one's ``clients``,
    asked at its own address), the frontends added up, and those that could not be asked."""
    totals: dict[str, dict[str, Any]] = {}
    reached, missed = [], []
    frontends = [(f.name, f.address) for f in reply.frontends if f.address] or [("", options.addr)]
    for name, address in frontends:
        try:
            one = reply if len(frontends) == 1 else await status(dataclasses.replace(options, addr=address))
        except grpc.aio.AioRpcError as exc:
            missed.append(f"{name or address}: {exc.code().name}")
            continue
        reached.append(name or address)
        for usage in one.clients:
            row = totals.setdefault(usage.client, {"client": usage.client})
            for key, value in message_dict(usage).items():
                if key != "client":
                    row[key] = row.get(key, 0) + value
    return sorted(totals.values(), key=lambda r: r["client"]), reached, missed


async def wait_serving(options: ClientOptions, wait_s: float) -> bool:
    """Poll the health service until SERVING or ``wait_s`` passes."""
    deadline = time.monotonic() + wait_s
    async with channel(options) as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        while True:
            try:
                reply = await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
            except grpc.aio.AioRpcError:
                pass
            if time.monotonic() > deadline:
                return False
            await asyncio.sleep(0.2)


def bill_line(outcome: Outcome) -> str:
    """One request's bill: tokens, then the end-to-end composition (frontend, then decode rank),
    then what the prefill ranks measured inside the KV wait."""
    s = outcome.summary
    assert s is not None
    b, lat, p = s.bill, s.bill.latency, s.placement

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:.2f}"

    error = f" error={s.error!r}" if s.error else ""
    t = b.cached_tokens_by_tier
    tiers = f": device {t.device}, host {t.host}, store {t.store}" if t.host or t.store else ""
    retries = f" attempts={len(b.attempts)}" if len(b.attempts) > 1 else ""
    return (
        f"[{outcome.index}] finish={s.finish_reason}{error} prompt={b.prompt_tokens} "
        f"(cached {b.cached_tokens}{tiers}, new {b.new_prompt_tokens}) output={b.output_tokens} "
        f"kv={b.kv_bytes}B{retries} ttft={ms(lat.ttft_s)}ms e2e={ms(lat.e2e_s)}ms "
        f"= queue {ms(lat.queue_s)} + routing {ms(lat.routing_s)} + pickup {ms(lat.pickup_s)} "
        f"+ reservation {ms(lat.reservation_wait_s)} + kv wait {ms(lat.kv_wait_s)} "
        f"+ accept {ms(lat.kv_accept_s)} + decode {ms(lat.decode_s)} "
        f"[kv wait: prefill queue {ms(lat.prefill_queue_s)}, compute {ms(lat.prefill_compute_s)}, "
        f"transfer {ms(lat.kv_transfer_s)} exposed {ms(lat.kv_transfer_exposed_s)}] "
        f"prefill={p.prefill_rank} decode={p.decode_rank} route={p.route_branch}"
        + (f" seed={b.seed}" if b.HasField("seed") else "")
        + (
            f" drafts={b.speculation.draft_tokens} accepted={b.speculation.accepted_tokens} "
            f"acceptance_length={b.speculation.acceptance_length:.2f}"
            if b.speculation.draft_tokens
            else ""
        )
    )


def run_generate(
    options: ClientOptions, specs: list[PromptSpec], concurrency: int, stream: bool, as_json: bool
) -> int:
    def on_chunk(index: int, chunk: tandem_pb2.Chunk) -> None:
        if not chunk.text:
            return
        if len(specs) == 1:
            emit(chunk.text, end="")
        else:
            emit(f"[{index}] {chunk.text!r}")

    outcomes = asyncio.run(
        generate_all(options, specs, concurrency, on_chunk if stream and not as_json else None)
    )
    if as_json:
        emit(json.dumps({"outputs": [o.record() for o in outcomes]}))
        return 0
    if stream and len(specs) == 1:
        emit()
    for outcome in outcomes:
        assert outcome.summary is not None
        if not stream:
            emit(f"[{outcome.index}] {outcome.summary.text}")
        emit(bill_line(outcome))
    return 0
