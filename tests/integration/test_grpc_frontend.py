"""The gRPC frontend on a real cluster (Ray, NIXL, grpc.aio on loopback), local shape: DEP2 prefill
+ DEP2 decode, float64, pages of 8 tokens, bearer-token auth.

The frontend starts before the controller, so health is seen NOT_SERVING until the pools are
ready; the module ends by draining the prefill pool, which turns it NOT_SERVING again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import ray
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.client.grpc_client import ClientOptions, Outcome, generate_all, request_message
from tandem.client.prompts import PromptSpec
from tandem.cluster.controller import Controller
from tandem.cluster.ray_bootstrap import init_ray, shutdown_ray
from tandem.cluster.topology import PoolSpec, Topology
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.frontend.actor import Frontend
from tandem.frontend.core import FRONTEND_NAME, FrontendConfig
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.protos import tandem_pb2, tandem_pb2_grpc
from tandem.wire.request_params import SamplingParams
from tandem.wire.routing_view import CONTROLLER_NAME

PAGE = 8
TOKEN = "s3cret-test-token"
MAX_RUNNING = 32
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@dataclass
class Served:
    addr: str
    tiny: Path
    controller: Any
    frontend: Any
    health_before_ready: list[int]


def _health(addr: str) -> int:
    with grpc.insecure_channel(addr) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=5
        )
        return int(reply.status)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tiny = make_tiny_checkpoint(tmp_path_factory.mktemp("frontend") / "tiny", seed=0)
    init_ray()
    config = FrontendConfig(str(tiny), "tiny", port=0, auth_token=TOKEN, max_running_requests=MAX_RUNNING)
    frontend = Frontend.options(name=FRONTEND_NAME).remote(config)  # type: ignore[attr-defined]
    controller = None
    try:
        addr = f"127.0.0.1:{ray.get(frontend.start.remote())}"
        before = []
        for _ in range(3):  # no controller yet: the pools cannot be ready
            before.append(_health(addr))
            time.sleep(0.2)
        pool = PoolSpec(dep=2, page_size=PAGE, num_pages=200)  # 1600 tokens a rank
        topology = Topology.preset("local").model_copy(update={"prefill": pool, "decode": pool})
        controller = Controller.options(name=CONTROLLER_NAME).remote(topology, str(tiny), "float64")  # type: ignore[attr-defined]
        ray.get(controller.start.remote())
        assert ray.get(frontend.wait_ready.remote(60.0))
        yield Served(addr, tiny, controller, frontend, before)
    finally:
        ray.get(frontend.stop.remote())
        ray.kill(frontend)
        if controller is not None:
            ray.get(controller.stop.remote())
            ray.kill(controller)
        shutdown_ray()


def _options(served: Served, timeout_s: float | None = 120.0) -> ClientOptions:
    return ClientOptions(served.addr, TOKEN, timeout_s=timeout_s)


def _status(served: Served, check_integrity: bool = False) -> tandem_pb2.ClusterStatusResponse:
    with grpc.insecure_channel(served.addr) as channel:
        request = tandem_pb2.ClusterStatusRequest(check_integrity=check_integrity)
        reply: tandem_pb2.ClusterStatusResponse = tandem_pb2_grpc.TandemStub(channel).ClusterStatus(
            request, metadata=AUTH, timeout=30
        )
        return reply


def _wait_all_pages_free(served: Served, timeout_s: float = 30.0) -> tandem_pb2.ClusterStatusResponse:
    """Every rank's pages free (a prefill rank's cached prefixes count as free: they are
    evictable), no transfer open, page accounting intact, nothing routed."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = _status(served, check_integrity=True)
        ranks = [r for g in status.groups for r in g.ranks]
        settled = status.running_requests == 0 and all(
            r.free_pages == r.total_pages and r.transfers_in_flight == 0 and r.running == 0 and r.queued == 0
            for r in ranks
        )
        if settled or time.monotonic() > deadline:
            assert all(r.integrity == "ok" for r in ranks), [(r.name, r.integrity) for r in ranks]
            assert settled, status
            assert all(r.routed_prefill_tokens == 0 and r.routed_requests == 0 for r in ranks), status
            return status
        time.sleep(0.1)


def _generate(served: Served, specs: list[PromptSpec], concurrency: int) -> list[Outcome]:
    return asyncio.run(generate_all(_options(served), specs, concurrency))


def _expected(tiny: Path, specs: list[PromptSpec]) -> list[list[int]]:
    engine = ColocatedEngine.from_model_dir(tiny, torch.float64, EngineConfig(page_size=PAGE, num_pages=512))
    prompts = [s.token_ids or engine.tokenizer.encode(s.text or "") for s in specs]
    return [o.token_ids for o in engine.generate(prompts, [s.sampling for s in specs])]


def test_health_turns_serving_only_once_the_pools_are_ready(served: Served) -> None:
    not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
    assert served.health_before_ready == [not_serving] * 3
    assert _health(served.addr) == health_pb2.HealthCheckResponse.SERVING
    assert _status(served).ready


def test_a_generic_reflection_client_lists_the_service(served: Served) -> None:
    from google.protobuf.descriptor_pool import DescriptorPool
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
        ProtoReflectionDescriptorDatabase,
    )

    class _Auth(grpc.UnaryStreamClientInterceptor, grpc.StreamStreamClientInterceptor):  # type: ignore[misc]
        def _add(self, details: Any) -> Any:
            return details._replace(metadata=[*(details.metadata or ()), *AUTH])

        def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
            return continuation(self._add(details), request)

        def intercept_stream_stream(self, continuation: Any, details: Any, requests: Any) -> Any:
            return continuation(self._add(details), requests)

    with grpc.insecure_channel(served.addr) as plain:
        channel = grpc.intercept_channel(plain, _Auth())
        database = ProtoReflectionDescriptorDatabase(channel)
        services = set(database.get_services())
        assert {"tandem.v1.Tandem", "grpc.health.v1.Health"} <= services
        service = DescriptorPool(database).FindServiceByName("tandem.v1.Tandem")
        generate = service.methods_by_name["Generate"]
        assert generate.server_streaming and generate.output_type.full_name == "tandem.v1.GenerateResponse"


def test_reflection_v1_and_health_list_answer_as_current_clients_ask(served: Served) -> None:
    """grpcurl and Postman ask for ``grpc.reflection.v1`` first: it lists the services as
    ``v1alpha`` does; health's ``List`` gives every service's status (the server's own, "")."""
    from grpc_reflection.v1alpha import reflection_pb2

    with grpc.insecure_channel(served.addr) as channel:
        call = channel.stream_stream(
            "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
            request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
            response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
        )
        replies = list(call(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), metadata=AUTH))
        listed = {s.name for s in replies[0].list_services_response.service}
        assert {
            "tandem.v1.Tandem",
            "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection",
        } <= listed
        described = list(
            call(
                iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="tandem.v1.Tandem")]),
                metadata=AUTH,
            )
        )
        assert described[0].file_descriptor_response.file_descriptor_proto  # the proto, serialized
        statuses = (
            health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=5).statuses
        )
        assert statuses[""].status == health_pb2.HealthCheckResponse.SERVING


def _prompts(n: int, seed: int) -> list[PromptSpec]:
    rng = random.Random(seed)
    specs = []
    for i in range(n):
        sampling = SamplingParams(
            max_tokens=rng.randrange(4, 12), temperature=0.8 if i % 2 else 0.0, seed=i, ignore_eos=i % 3 != 0
        )
        if i % 4 == 0:
            specs.append(PromptSpec(f"request {i}: tell me about prefill and decode", None, sampling))
        else:
            specs.append(
                PromptSpec(None, [rng.randrange(256) for _ in range(rng.randrange(1, 40))], sampling)
            )
    return specs


def _kv_bytes(status: tandem_pb2.ClusterStatusResponse) -> tuple[int, int]:
    ranks = [r for g in status.groups for r in g.ranks]
    return sum(r.kv_bytes_sent for r in ranks), sum(r.kv_bytes_received for r in ranks)


def test_32_concurrent_streams_give_the_colocated_engine_tokens(served: Served) -> None:
    specs = _prompts(32, seed=3)
    sent_before, received_before = _kv_bytes(_status(served))
    decode_ranks = sum(len(g.ranks) for g in _status(served).groups if g.role == "decode")
    deadline = time.monotonic() + 30  # each decode rank's channel, opened in the background
    while (before := ray.get(served.frontend.submits.remote()))["open_channels"] < decode_ranks:
        assert time.monotonic() < deadline, before
        time.sleep(0.05)
    outcomes = _generate(served, specs, concurrency=32)
    after = ray.get(served.frontend.submits.remote())
    assert (after["channel"] - before["channel"], after["unreachable"] - before["unreachable"]) == (32, 0)
    expected = _expected(served.tiny, specs)
    assert [list(o.summary.token_ids) for o in outcomes if o.summary] == expected
    for spec, outcome, tokens in zip(specs, outcomes, expected, strict=True):
        summary = outcome.summary
        assert summary is not None and summary.error == ""
        streamed = [t for c in outcome.chunks for t in c.token_ids]
        assert streamed == tokens
        for chunk in outcome.chunks:  # every chunk carries one timing per token, in columns
            assert len(chunk.server_times_s) == len(chunk.gaps_s) == len(chunk.token_ids)
        starts = [c.first_index for c in outcome.chunks]
        assert starts == list(
            itertools.accumulate((len(c.token_ids) for c in outcome.chunks[:-1]), initial=0)
        )
        gaps = [g for c in outcome.chunks for g in c.gaps_s]
        times = [t for c in outcome.chunks for t in c.server_times_s]
        assert gaps[0] > 0 and all(g >= 0 for g in gaps)
        assert times == sorted(times) and times[0] > 1.6e9  # Unix seconds
        bill = summary.bill
        assert bill.cached_tokens + bill.new_prompt_tokens == bill.prompt_tokens > 0
        assert bill.output_tokens == len(tokens)
        if summary.finish_reason == "length":
            assert bill.output_tokens == spec.sampling.max_tokens
        else:
            assert summary.finish_reason == "stop" and not spec.sampling.ignore_eos
        lat = bill.latency
        assert 0 < lat.ttft_s <= lat.e2e_s and lat.prefill_compute_s > 0
        assert summary.placement.prefill_rank.startswith("prefill0-r")
        assert summary.placement.decode_rank.startswith("decode0-r")
    status = _wait_all_pages_free(served)
    # the ranks' own counters (what their /metrics exports) agree with the bills
    sent, received = _kv_bytes(status)
    billed = sum(o.summary.bill.kv_bytes for o in outcomes if o.summary)
    assert sent - sent_before == received - received_before == billed > 0
    for rank in (r for g in status.groups for r in g.ranks):
        assert rank.steps > 0 and rank.step_s > 0 and rank.incarnation == 1 and rank.kv_cache_usage_ratio == 0
        if rank.role == "prefill":
            assert rank.prefix_queried_tokens >= rank.prefix_hit_tokens >= 0


def test_a_repeated_prefix_goes_to_the_rank_that_holds_it(served: Served) -> None:
    rng = random.Random(7)
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    for conversation in range(3):
        first = [rng.randrange(256) for _ in range(5 * PAGE + 3)]
        (a,) = _generate(served, [PromptSpec(None, first, sampling)], 1)
        assert a.summary is not None
        holder = a.summary.placement.prefill_rank
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the rank's KV events reach the router
            status = _status(served)
            if any(r.name == holder and r.indexed_blocks >= 5 for g in status.groups for r in g.ranks):
                break
            time.sleep(0.05)
        follow_up = first + list(a.summary.token_ids) + [rng.randrange(256) for _ in range(4)]
        (b,) = _generate(served, [PromptSpec(None, follow_up, sampling)], 1)
        assert b.summary is not None
        placement, bill = b.summary.placement, b.summary.bill
        assert placement.prefill_rank == holder, conversation
        assert placement.route_branch == "cache_hit"
        assert placement.predicted_cached_tokens == bill.cached_tokens >= 5 * PAGE
    counters = _status(served).router_counters
    assert counters["branch_cache_hit"] >= 3 and counters["matched_blocks"] >= 15
    _wait_all_pages_free(served)


async def _first_chunks(stub: Any, message: Any, n: int, **kwargs: Any) -> Any:
    call = stub.Generate(message, metadata=AUTH, **kwargs)
    seen = 0
    async for response in call:
        seen += response.HasField("chunk")
        if seen >= n:
            return call
    raise AssertionError("the stream ended early")


def test_a_cancelled_stream_frees_its_pages_on_both_sides(served: Served) -> None:
    long = PromptSpec(None, list(range(30)), SamplingParams(max_tokens=1500, ignore_eos=True))

    async def cancel_midway() -> None:
        async with grpc.aio.insecure_channel(served.addr) as channel:
            stub = tandem_pb2_grpc.TandemStub(channel)
            call = await _first_chunks(stub, request_message(long, "cancel-me"), 3)
            status = _status(served)
            assert status.running_requests == 1
            assert any(
                r.free_pages < r.total_pages for g in status.groups if g.role == "decode" for r in g.ranks
            )
            call.cancel()

    asyncio.run(cancel_midway())
    _wait_all_pages_free(served)


def test_an_id_is_free_again_the_moment_its_stream_ends(served: Served) -> None:
    """Cancelled during its prefill, then sent again at once under the same id: the ranks still
    wind the first one down, and the second runs in full."""
    spec = PromptSpec(None, list(range(60)), SamplingParams(max_tokens=5, ignore_eos=True))

    async def twice() -> tandem_pb2.Summary:
        async with grpc.aio.insecure_channel(served.addr) as channel:
            stub = tandem_pb2_grpc.TandemStub(channel)
            first = stub.Generate(request_message(spec, "same-id"), metadata=AUTH)
            await asyncio.sleep(0.05)
            first.cancel()
            async for response in stub.Generate(request_message(spec, "same-id"), metadata=AUTH):
                if response.HasField("summary"):
                    return response.summary
            raise AssertionError("no summary")

    summary = asyncio.run(twice())
    assert summary.error == "" and list(summary.token_ids) == _expected(served.tiny, [spec])[0]
    _wait_all_pages_free(served)


def test_a_deadline_aborts_the_request(served: Served) -> None:
    long = PromptSpec(None, list(range(20)), SamplingParams(max_tokens=1500, ignore_eos=True))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        asyncio.run(generate_all(_options(served, timeout_s=1.0), [long], 1))
    assert error.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_all_pages_free(served)


def test_the_abort_rpc_ends_the_stream(served: Served) -> None:
    long = PromptSpec(None, list(range(12)), SamplingParams(max_tokens=1500, ignore_eos=True))

    async def abort_midway() -> tandem_pb2.Summary:
        async with grpc.aio.insecure_channel(served.addr) as channel:
            stub = tandem_pb2_grpc.TandemStub(channel)
            call = await _first_chunks(stub, request_message(long, "abort-me"), 2)
            reply = await stub.Abort(tandem_pb2.AbortRequest(request_id="abort-me"), metadata=AUTH)
            assert reply.found
            async for response in call:
                if response.HasField("summary"):
                    return response.summary
            raise AssertionError("no summary")

    summary = asyncio.run(abort_midway())
    assert summary.finish_reason == "abort"
    assert 2 <= summary.bill.output_tokens < 1500
    with grpc.insecure_channel(served.addr) as channel:
        reply = tandem_pb2_grpc.TandemStub(channel).Abort(
            tandem_pb2.AbortRequest(request_id="no-such-request"), metadata=AUTH, timeout=10
        )
        assert not reply.found
    _wait_all_pages_free(served)


def _call(served: Served, message: tandem_pb2.GenerateRequest, metadata: Any = AUTH) -> grpc.RpcError:
    with grpc.insecure_channel(served.addr) as channel:
        with pytest.raises(grpc.RpcError) as error:
            list(tandem_pb2_grpc.TandemStub(channel).Generate(message, metadata=metadata, timeout=30))
        return error.value


def _message(**fields: Any) -> tandem_pb2.GenerateRequest:
    sampling = fields.pop("sampling", tandem_pb2.SamplingParams(max_tokens=4))
    return tandem_pb2.GenerateRequest(sampling=sampling, **fields)


@pytest.mark.parametrize(
    ("message", "field"),
    [
        (_message(text=""), "text"),
        (_message(token_ids=tandem_pb2.TokenIds(ids=[])), "token_ids"),
        (_message(), "prompt"),
        (_message(token_ids=tandem_pb2.TokenIds(ids=[1, 2, 999])), "token_ids"),
        (_message(token_ids=tandem_pb2.TokenIds(ids=[-1])), "token_ids"),
        (_message(token_ids=tandem_pb2.TokenIds(ids=[1] * 2048)), "token_ids"),
        (_message(text="hi", sampling=tandem_pb2.SamplingParams(max_tokens=0)), "sampling.max_tokens"),
        (_message(text="hi", sampling=tandem_pb2.SamplingParams(max_tokens=4, top_p=1.5)), "sampling.top_p"),
        (_message(text="hi", sampling=tandem_pb2.SamplingParams(max_tokens=4, top_k=-2)), "sampling.top_k"),
        (
            _message(text="hi", sampling=tandem_pb2.SamplingParams(max_tokens=4, temperature=-1)),
            "sampling.temperature",
        ),
        (
            _message(text="hi", sampling=tandem_pb2.SamplingParams(max_tokens=4, stop_token_ids=[300])),
            "sampling.stop_token_ids",
        ),
        (tandem_pb2.GenerateRequest(text="hi"), "sampling"),
        (_message(text="hi", model="gpt-9"), "model"),
        (_message(text="hi", sampling=tandem_pb2.SamplingParams(max_tokens=1900)), "sampling.max_tokens"),
        (_message(text="hi", request_id="a\n1"), "request_id"),
        (_message(text="hi", sampling=tandem_pb2.SamplingParams(max_tokens=4, seed=2**63)), "sampling.seed"),
    ],
)
def test_bad_input_is_invalid_argument_naming_the_field(
    served: Served, message: tandem_pb2.GenerateRequest, field: str
) -> None:
    error = _call(served, message)
    assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
    assert error.details().startswith(f"{field}:"), error.details()


def test_missing_or_wrong_tokens_are_unauthenticated(served: Served) -> None:
    message = _message(text="hi")
    for metadata in [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)]:
        error = _call(served, message, metadata)
        assert error.code() is grpc.StatusCode.UNAUTHENTICATED, error
    with grpc.insecure_channel(served.addr) as channel:
        with pytest.raises(grpc.RpcError) as status_error:
            tandem_pb2_grpc.TandemStub(channel).ClusterStatus(tandem_pb2.ClusterStatusRequest(), timeout=10)
        assert status_error.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert _health(served.addr) == health_pb2.HealthCheckResponse.SERVING  # health needs no token
    # and the server keeps serving
    (ok,) = _generate(served, [PromptSpec("still here", None, SamplingParams(max_tokens=2))], 1)
    assert ok.summary is not None and ok.summary.error == ""


def test_overload_and_duplicate_ids(served: Served) -> None:
    long = SamplingParams(max_tokens=1500, ignore_eos=True)

    async def fill_up() -> None:
        async with grpc.aio.insecure_channel(served.addr) as channel:
            stub = tandem_pb2_grpc.TandemStub(channel)
            calls = [
                stub.Generate(
                    request_message(PromptSpec(None, [i + 1, 2, 3], long), f"fill-{i}"), metadata=AUTH
                )
                for i in range(MAX_RUNNING)
            ]
            deadline = time.monotonic() + 30
            while _status(served).running_requests < MAX_RUNNING:
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            for message, code in [
                (request_message(PromptSpec("one more", None, long)), grpc.StatusCode.RESOURCE_EXHAUSTED),
                (request_message(PromptSpec("again", None, long), "fill-0"), grpc.StatusCode.ALREADY_EXISTS),
            ]:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    async for _ in stub.Generate(message, metadata=AUTH):
                        pass
                assert error.value.code() is code, error.value
            for call in calls:
                call.cancel()

    asyncio.run(fill_up())
    _wait_all_pages_free(served, timeout_s=60)


def _self_signed(tmp: Path) -> tuple[str, str]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost")]), critical=False)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    cert_file, key_file = tmp / "cert.pem", tmp / "key.pem"
    cert_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )
    )
    return str(cert_file), str(key_file)


def test_a_second_frontend_serves_tls(served: Served, tmp_path: Path) -> None:
    """Another frontend on the same pools, over TLS: ranks stream to whichever frontend asked."""
    cert, key = _self_signed(tmp_path)
    config = FrontendConfig(
        str(served.tiny), "tiny", host="localhost", port=0, tls_cert_file=cert, tls_key_file=key,
        name="tandem-frontend-tls",
    )  # fmt: skip
    frontend = Frontend.options(name=config.name).remote(config)  # type: ignore[attr-defined]
    try:
        addr = f"localhost:{ray.get(frontend.start.remote())}"
        assert ray.get(frontend.wait_ready.remote(60.0))
        spec = PromptSpec("over TLS", None, SamplingParams(max_tokens=4, ignore_eos=True))
        (outcome,) = asyncio.run(generate_all(ClientOptions(addr, tls_ca_file=cert, timeout_s=60), [spec], 1))
        assert outcome.summary is not None and outcome.summary.bill.output_tokens == 4
        assert list(outcome.summary.token_ids) == _expected(served.tiny, [spec])[0]
        with pytest.raises(grpc.aio.AioRpcError) as plaintext:
            asyncio.run(generate_all(ClientOptions(addr, timeout_s=10), [spec], 1))
        assert plaintext.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        ray.get(frontend.stop.remote())
        ray.kill(frontend)
    _wait_all_pages_free(served)


def test_a_decode_rank_dying_mid_stream_resumes_it_on_its_rebuilt_group(served: Served) -> None:
    """The only decode group loses a rank mid-stream: the request waits for the group's rebuild
    and resumes there from the tokens already streamed; the stream ends without an error and
    with the colocated engine's tokens, its bill counting one migration."""
    long = PromptSpec(None, list(range(10)), SamplingParams(max_tokens=1500, ignore_eos=True))

    async def kill_midway() -> tuple[tandem_pb2.Summary, float]:
        async with grpc.aio.insecure_channel(served.addr) as channel:
            stub = tandem_pb2_grpc.TandemStub(channel)
            call = await _first_chunks(stub, request_message(long, "doomed"), 2)
            status = _status(served)
            (rank,) = [r.name for g in status.groups if g.role == "decode" for r in g.ranks if r.running]
            view = ray.get(served.controller.routing_view.remote())
            ray.kill({r.name: a for r, a in view.decode.items()}[rank])
            killed = time.monotonic()
            async for response in call:
                if response.HasField("summary"):
                    return response.summary, time.monotonic() - killed
            raise AssertionError("no summary")

    summary, _ = asyncio.run(kill_midway())
    assert summary.finish_reason == "length" and not summary.error, summary.error
    assert summary.bill.migrations == 1 and summary.bill.prompt_tokens == 10
    assert list(summary.token_ids) == _expected(served.tiny, [long])[0]
    deadline = time.monotonic() + 180  # the group is rebuilt; health follows
    while True:
        status = _status(served)
        decode = [(g.state, g.incarnation) for g in status.groups if g.role == "decode"]
        health = _health(served.addr)
        if decode == [("ready", 2)] and status.ready and health == health_pb2.HealthCheckResponse.SERVING:
            break
        assert time.monotonic() < deadline, decode
        time.sleep(0.1)
    spec = PromptSpec("after the rebuild", None, SamplingParams(max_tokens=3, ignore_eos=True))
    (after,) = _generate(served, [spec], 1)
    assert after.summary is not None and list(after.summary.token_ids) == _expected(served.tiny, [spec])[0]
    _wait_all_pages_free(served)


def test_two_identical_unseeded_requests_are_two_different_samples(served: Served) -> None:
    """No seed, temperature 1: each request gets a seed of its own, drawn by the frontend and
    reported in the bill, so two users sending the same prompt get two samples; the billed seed,
    sent back, replays the sample exactly."""
    spec = PromptSpec(
        "In the beginning", None, SamplingParams(max_tokens=32, temperature=1.0, ignore_eos=True)
    )
    pairs = []
    for _ in range(3):  # a chance coincidence of 32 sampled tokens twice in a row fails nothing
        first, second = _generate(served, [spec, spec], concurrency=2)
        assert first.summary is not None and second.summary is not None
        pairs.append((first.summary, second.summary))
        if first.summary.token_ids != second.summary.token_ids:
            break
    assert any(a.token_ids != b.token_ids for a, b in pairs), "every pair of unseeded samples was equal"
    a, b = pairs[-1]
    assert a.bill.HasField("seed") and b.bill.HasField("seed") and a.bill.seed != b.bill.seed
    replay = PromptSpec(spec.text, None, dataclasses.replace(spec.sampling, seed=a.bill.seed))
    (again,) = _generate(served, [replay], concurrency=1)
    assert again.summary is not None and again.summary.token_ids == a.token_ids
    assert again.summary.bill.seed == a.bill.seed
    assert list(a.token_ids) == _expected(served.tiny, [replay])[0]  # the colocated engine's sample
    _wait_all_pages_free(served)


def test_draining_the_prefill_pool_turns_health_not_serving(served: Served) -> None:
    """Last in the module: nothing serves afterwards."""
    ray.get(served.controller.drain.remote("prefill0"))
    deadline = time.monotonic() + 10
    while _health(served.addr) != health_pb2.HealthCheckResponse.NOT_SERVING:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    error = _call(served, _message(text="anyone?"))
    assert error.code() is grpc.StatusCode.UNAVAILABLE
