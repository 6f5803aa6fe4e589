"""Limits at the gRPC edge on a real cluster (Ray, NIXL, grpc.aio on loopback): DEP1 prefill +
DEP1 decode, float64, two clients with their own bearer tokens, streams that hold one chunk for
a slow reader. Ends with a property-based fuzz of the whole request
surface, after which the server still gives the colocated engine's tokens."""

from __future__ import annotations

import asyncio
import string
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import ray
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tandem.client.grpc_client import request_message
from tandem.client.prompts import PromptSpec
from tandem.cluster.controller import Controller
from tandem.cluster.ray_bootstrap import init_ray, shutdown_ray
from tandem.cluster.topology import PoolSpec, Topology
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.frontend.actor import Frontend
from tandem.frontend.core import FRONTEND_NAME, FrontendConfig
from tandem.frontend.limits import EdgeLimits
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.protos import tandem_pb2, tandem_pb2_grpc
from tandem.wire.request_params import SamplingParams
from tandem.wire.routing_view import CONTROLLER_NAME

PAGE = 8
STALLED_TOKENS = 32  # tokens a stream whose writes stalled holds in its one chunk
TOKENS = "alice:tok-alice\nbob:tok-bob\n"
ALICE = (("authorization", "Bearer tok-alice"),)
BOB = (("authorization", "Bearer tok-bob"),)
LONG = SamplingParams(max_tokens=1500, ignore_eos=True)


@dataclass
class Served:
    addr: str
    tiny: Path
    controller: Any
    frontend: Any


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tiny = make_tiny_checkpoint(tmp_path_factory.mktemp("limits") / "tiny", seed=0)
    init_ray()
    limits = EdgeLimits()
    config = FrontendConfig(
        str(tiny), "tiny", port=0, auth_token=TOKENS, max_running_requests=64, limits=limits
    )
    frontend = Frontend.options(name=FRONTEND_NAME).remote(config)  # type: ignore[attr-defined]
    controller = None
    try:
        addr = f"127.0.0.1:{ray.get(frontend.start.remote())}"
        pool = PoolSpec(dep=1, page_size=PAGE, num_pages=3000)
        topology = Topology.preset("local").model_copy(update={"prefill": pool, "decode": pool})
        controller = Controller.options(name=CONTROLLER_NAME).remote(topology, str(tiny), "float64")  # type: ignore[attr-defined]
        ray.get(controller.start.remote())
        assert ray.get(frontend.wait_ready.remote(60.0))
        yield Served(addr, tiny, controller, frontend)
    finally:
        ray.get(frontend.stop.remote())
        ray.kill(frontend)
        if controller is not None:
            ray.get(controller.stop.remote())
            ray.kill(controller)
        shutdown_ray()


def _expected(tiny: Path, specs: list[PromptSpec]) -> list[list[int]]:
    engine = ColocatedEngine.from_model_dir(tiny, torch.float64, EngineConfig(page_size=PAGE, num_pages=512))
    prompts = [s.token_ids or engine.tokenizer.encode(s.text or "") for s in specs]
    return [o.token_ids for o in engine.generate(prompts, [s.sampling for s in specs])]


def _wait_idle(served: Served, timeout_s: float = 60.0) -> None:
    """No request running, every page free, page accounting intact."""
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(served.addr) as channel:
        stub = tandem_pb2_grpc.TandemStub(channel)
        while True:
            status = stub.ClusterStatus(
                tandem_pb2.ClusterStatusRequest(check_integrity=True), metadata=ALICE, timeout=30
            )
            ranks = [r for g in status.groups for r in g.ranks]
            if status.running_requests == 0 and all(r.free_pages == r.total_pages for r in ranks):
                assert all(r.integrity == "ok" for r in ranks), status
                return
            assert time.monotonic() < deadline, status
            time.sleep(0.1)


async def _summary(call: Any) -> tandem_pb2.Summary:
    async for response in call:
        if response.HasField("summary"):
            return response.summary
    raise AssertionError("no summary")


async def _started(call: Any) -> Any:
    """``call`` once its first chunk came."""
    async for response in call:
        if response.HasField("chunk"):
            return call
    raise AssertionError("the stream ended early")


def test_two_clients_use_one_id_and_each_aborts_only_its_own(served: Served) -> None:
    spec = PromptSpec(None, [5, 6, 7], LONG)

    async def run() -> tuple[tandem_pb2.Summary, tandem_pb2.Summary, bool]:
        async with grpc.aio.insecure_channel(served.addr) as channel:
            stub = tandem_pb2_grpc.TandemStub(channel)
            alice = await _started(stub.Generate(request_message(spec, "shared"), metadata=ALICE))
            bob = await _started(stub.Generate(request_message(spec, "shared"), metadata=BOB))
            only_alice = await _started(stub.Generate(request_message(spec, "alice-only"), metadata=ALICE))
            stray = await stub.Abort(tandem_pb2.AbortRequest(request_id="alice-only"), metadata=BOB)
            assert (await stub.Abort(tandem_pb2.AbortRequest(request_id="shared"), metadata=BOB)).found
            bob_summary = await _summary(bob)
            # alice's request of the same id keeps streaming; then she aborts both of hers
            await _started(alice)
            for request_id in ("shared", "alice-only"):
                reply = await stub.Abort(tandem_pb2.AbortRequest(request_id=request_id), metadata=ALICE)
                assert reply.found
            alice_summary = await _summary(alice)
            await _summary(only_alice)
            return bob_summary, alice_summary, stray.found

    bob, alice, stray_found = asyncio.run(run())
    assert not stray_found  # bob cannot see alice's id
    assert bob.finish_reason == alice.finish_reason == "abort"
    assert bob.bill.output_tokens < alice.bill.output_tokens < 1500
    _wait_idle(served)


def test_a_client_at_its_limit_is_resource_exhausted_and_others_are_served(served: Served) -> None:
    """A second frontend on the same pools, with at most two streams per client."""
    config = FrontendConfig(
        str(served.tiny), "tiny", port=0, auth_token=TOKENS, name="tandem-frontend-capped",
        limits=EdgeLimits(max_requests_per_client=2),
    )  # fmt: skip
    frontend = Frontend.options(name=config.name).remote(config)  # type: ignore[attr-defined]
    try:
        addr = f"127.0.0.1:{ray.get(frontend.start.remote())}"
        assert ray.get(frontend.wait_ready.remote(60.0))

        async def run() -> tuple[grpc.aio.AioRpcError, tandem_pb2.Summary]:
            async with grpc.aio.insecure_channel(addr) as channel:
                stub = tandem_pb2_grpc.TandemStub(channel)
                spec = PromptSpec(None, [1, 2, 3], LONG)
                calls = [
                    await _started(stub.Generate(request_message(spec, f"a{i}"), metadata=ALICE))
                    for i in range(2)
                ]
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await _summary(stub.Generate(request_message(spec, "a2"), metadata=ALICE))
                short = PromptSpec(None, [1, 2, 3], SamplingParams(max_tokens=3, ignore_eos=True))
                served_to_bob = await _summary(stub.Generate(request_message(short, "a2"), metadata=BOB))
                for call in calls:
                    call.cancel()
                return refused.value, served_to_bob

        refused, bob = asyncio.run(run())
        assert refused.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, refused
        assert "max_requests_per_client=2" in refused.details()
        assert bob.error == "" and bob.bill.output_tokens == 3
    finally:
        ray.get(frontend.stop.remote())
        ray.kill(frontend)
    _wait_idle(served)


def test_streams_nobody_reads_hold_bounded_buffers_while_others_are_served(served: Served) -> None:
    """32 streams whose client never reads (a small HTTP/2 window, so the server's writes stall):
    each holds one chunk, which its tokens join (and then the summary), and another client
    meanwhile gets the colocated engine's tokens."""
    unread = [
        PromptSpec(None, [i + 1, 9, 9], SamplingParams(max_tokens=600, ignore_eos=True)) for i in range(32)
    ]
    reference = PromptSpec("and meanwhile", None, SamplingParams(max_tokens=8, ignore_eos=True))
    window = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]

    async def run() -> tuple[list[int], int, tandem_pb2.Summary]:
        async with (
            grpc.aio.insecure_channel(served.addr, options=window) as slow,
            grpc.aio.insecure_channel(served.addr) as fast,
        ):
            slow_stub = tandem_pb2_grpc.TandemStub(slow)
            calls = [
                slow_stub.Generate(request_message(s, f"unread-{i}"), metadata=ALICE)
                for i, s in enumerate(unread)
            ]
            for call in calls:  # sent; never read
                await call.initial_metadata()
            most, full = [], 0
            deadline = time.monotonic() + 120
            while full < len(unread) and time.monotonic() < deadline:
                buffers = await served.frontend.stream_buffers.remote()
                most.append(max((b.items for b in buffers), default=0))
                full = sum(b.tokens >= STALLED_TOKENS for b in buffers)
                await asyncio.sleep(0.2)
            stub = tandem_pb2_grpc.TandemStub(fast)
            summary = await _summary(stub.Generate(request_message(reference, "meanwhile"), metadata=BOB))
            buffers = await served.frontend.stream_buffers.remote()
            most.append(max(b.items for b in buffers if b.key.client == "alice"))
            for call in calls:
                call.cancel()
            return most, full, summary

    most, full, summary = asyncio.run(run())
    assert max(most) <= 2, most  # a chunk and the summary
    assert full == len(unread)  # every stream's writes stalled, and its tokens joined one chunk
    assert list(summary.token_ids) == _expected(served.tiny, [reference])[0]
    _wait_idle(served)


# ---- fuzz ---------------------------------------------------------------------------------
INT64 = st.integers(-(2**63), 2**63 - 1)
ID_CHARS = string.ascii_letters + string.digits + "-_./:+="
# every field's values: ones the server takes, and anything the wire carries
VALID = {
    "request_id": st.text(ID_CHARS, max_size=40),
    "model": st.sampled_from(["", "tiny"]),
    "prompt": st.one_of(
        st.text(min_size=1, max_size=60), st.lists(st.integers(0, 257), min_size=1, max_size=40)
    ),
    "max_tokens": st.integers(1, 4),
    "temperature": st.floats(0, 2, width=32),
    "top_p": st.none() | st.floats(0, 1, exclude_min=True, width=32),
    "top_k": st.integers(0, 300),
    "seed": st.none() | st.integers(0, 2**63 - 1),
    "stop_token_ids": st.lists(st.integers(0, 257), max_size=8),
}
WILD = {
    "request_id": st.one_of(st.text(ID_CHARS, min_size=120, max_size=140), st.text(max_size=140)),
    "model": st.text(max_size=80),
    "prompt": st.one_of(
        st.none(),
        st.just(""),
        st.text(max_size=300),
        st.lists(st.one_of(st.integers(-2, 300), INT64), max_size=40),
        st.sampled_from([2047, 2048, 70_000]).map(lambda n: [1] * n),
    ),
    "max_tokens": st.one_of(st.integers(-1, 0), INT64, st.sampled_from([2000, 2047])),
    "temperature": st.floats(width=32),  # NaN and infinities included
    "top_p": st.floats(width=32),
    "top_k": INT64,
    "seed": st.integers(0, 2**64 - 1),
    "stop_token_ids": st.one_of(st.lists(st.integers(-2, 300), max_size=70), st.lists(INT64, max_size=80)),
}


@st.composite
def _requests(draw: Any) -> tandem_pb2.GenerateRequest:
    """A request whose fields are valid but for a few drawn at random (none, sometimes)."""
    wild = draw(st.sets(st.sampled_from([*VALID, "no sampling"]), max_size=3))
    value = {name: draw(WILD[name] if name in wild else VALID[name]) for name in VALID}
    message = tandem_pb2.GenerateRequest(request_id=value["request_id"], model=value["model"])
    prompt = value["prompt"]
    if isinstance(prompt, str):
        message.text = prompt
    elif prompt is not None:
        message.token_ids.ids.extend(prompt)
    if "no sampling" not in wild:
        sampling = message.sampling
        sampling.max_tokens, sampling.temperature = value["max_tokens"], value["temperature"]
        sampling.top_k, sampling.ignore_eos = value["top_k"], draw(st.booleans())
        sampling.stop_token_ids.extend(value["stop_token_ids"])
        if value["top_p"] is not None:
            sampling.top_p = value["top_p"]
        if value["seed"] is not None:
            sampling.seed = value["seed"]
    return message


REFUSALS = {
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.OUT_OF_RANGE,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.ALREADY_EXISTS,
}


def test_fuzzed_requests_get_a_refusal_or_a_stream_and_the_server_keeps_serving(served: Served) -> None:
    channel = grpc.insecure_channel(served.addr)
    stub = tandem_pb2_grpc.TandemStub(channel)
    outcomes: dict[str, int] = {}

    @settings(
        max_examples=80,
        deadline=None,
        derandomize=True,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    )
    @given(message=_requests(), who=st.sampled_from([ALICE, BOB]), raw=st.none() | st.binary(max_size=64))
    def one(message: tandem_pb2.GenerateRequest, who: Any, raw: bytes | None) -> None:
        if raw is not None:  # bytes that may not parse at all
            call = channel.unary_stream("/tandem.v1.Tandem/Generate")(raw, metadata=who, timeout=30)
        else:
            call = stub.Generate(message, metadata=who, timeout=30)
        try:
            first = next(call)
        except grpc.RpcError as error:
            assert error.code() in REFUSALS, (message, error.code(), error.details())
            outcomes[error.code().name] = outcomes.get(error.code().name, 0) + 1
        else:
            assert first.HasField("chunk") or first.HasField("summary")
            assert raw is not None or first.request_id == (message.request_id or first.request_id)
            outcomes["OK"] = outcomes.get("OK", 0) + 1
        finally:
            call.cancel()
        try:  # OK (found or not: the cancel above may not have landed yet), or a refused id
            stub.Abort(tandem_pb2.AbortRequest(request_id=message.request_id), metadata=who, timeout=30)
        except grpc.RpcError as error:
            assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (message.request_id, error)
            assert error.details().startswith("request_id:"), error.details()

    try:
        one()
        with pytest.raises(grpc.RpcError) as bad_abort:
            stub.Abort(tandem_pb2.AbortRequest(request_id="a\u00e9 b"), metadata=ALICE, timeout=30)
        assert bad_abort.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    finally:
        channel.close()
    assert outcomes.get("OK", 0) > 0 and outcomes.get("INVALID_ARGUMENT", 0) > 0, outcomes
    _wait_idle(served)
    spec = PromptSpec("after the fuzz", None, SamplingParams(max_tokens=6, ignore_eos=True))

    async def after() -> tandem_pb2.Summary:
        async with grpc.aio.insecure_channel(served.addr) as channel:
            stub = tandem_pb2_grpc.TandemStub(channel)
            return await _summary(stub.Generate(request_message(spec, "after"), metadata=ALICE))

    assert list(asyncio.run(after()).token_ids) == _expected(served.tiny, [spec])[0]
