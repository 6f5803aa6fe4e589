"""The gRPC edge without a cluster: a real ``grpc.aio`` server around a frontend core whose pools
are not ready, so a request that passes every check at the edge ends UNAVAILABLE, and one that
fails a check ends with the status and field the check names."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from tandem.frontend.core import FrontendConfig, FrontendCore
from tandem.frontend.grpc_auth import BearerAuth, ClientToken, exposure_warning, parse_client_tokens
from tandem.frontend.grpc_service import build_server
from tandem.frontend.limits import EdgeLimits
from tandem.frontend.request_checks import MAX_STOP_TOKEN_IDS, TEXT_CHARS_PER_TOKEN
from tandem.model.config import ModelConfig
from tandem.protos import tandem_pb2, tandem_pb2_grpc

GENERATE, ABORT = "/tandem.v1.Tandem/Generate", "/tandem.v1.Tandem/Abort"


@contextlib.asynccontextmanager
async def _serving(tiny_dir: Path, **config: Any) -> AsyncIterator[str]:
    core = FrontendCore(FrontendConfig(str(tiny_dir), "tiny", port=0, metrics=False, **config))
    server, _, port = build_server(core)
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


async def _generate_error(addr: str, request: bytes | tandem_pb2.GenerateRequest) -> grpc.aio.AioRpcError:
    data = request if isinstance(request, bytes) else request.SerializeToString()
    async with grpc.aio.insecure_channel(addr) as channel:
        call = channel.unary_stream(GENERATE)(data, timeout=10)
        with pytest.raises(grpc.aio.AioRpcError) as error:
            async for _ in call:
                pass
        return error.value


def _message(prompt: list[int] | str = "hi", **sampling: Any) -> tandem_pb2.GenerateRequest:
    fields: dict[str, Any] = {"text": prompt} if isinstance(prompt, str) else {"token_ids": {"ids": prompt}}
    sampling = {"max_tokens": 4, **sampling}
    return tandem_pb2.GenerateRequest(sampling=tandem_pb2.SamplingParams(**sampling), **fields)


def _with(message: tandem_pb2.GenerateRequest, **fields: Any) -> tandem_pb2.GenerateRequest:
    for name, value in fields.items():
        setattr(message, name, value)
    return message


def test_every_size_a_client_controls_is_capped_naming_the_field(tiny_dir: Path) -> None:
    context = ModelConfig.from_dir(tiny_dir).max_position_embeddings
    cases = [
        (_message(stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "sampling.stop_token_ids"),
        (_message(stop_token_ids=[1, 258]), "sampling.stop_token_ids"),
        (_message("a" * (TEXT_CHARS_PER_TOKEN * context + 1)), "text"),
        (_message([1] * context), "token_ids"),
        (_message([1] * 1_000_000), "token_ids"),
        (_message([1, 2], max_tokens=context - 1), "sampling.max_tokens"),
        (_message([1, 2], max_tokens=2**62), "sampling.max_tokens"),
        (_with(_message(), request_id="a b"), "request_id"),
        (_with(_message(), request_id="caf\u00e9"), "request_id"),
        (_with(_message(), request_id="x" * 129), "request_id"),
        (_with(_message(), model="m" * 100_000), "model"),
    ]

    async def run() -> list[grpc.aio.AioRpcError]:
        async with _serving(tiny_dir, limits=EdgeLimits(max_request_bytes=16 * 1024 * 1024)) as addr:
            return [await _generate_error(addr, message) for message, _ in cases]

    for (_, field), error in zip(cases, asyncio.run(run()), strict=True):
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, (field, error)
        assert error.details().startswith(f"{field}:"), error.details()
        assert len(error.details()) < 300  # a client's value is quoted cut short


def test_a_request_at_every_cap_passes_the_edge(tiny_dir: Path) -> None:
    """The largest prompt and output the context holds, the most stop ids: refused only because
    no pool is ready here."""
    context = ModelConfig.from_dir(tiny_dir).max_position_embeddings
    message = _message([1] * (context - 1), max_tokens=1, stop_token_ids=list(range(MAX_STOP_TOKEN_IDS)))
    message.request_id = "Az09._:/+=-" + "x" * 117

    async def run() -> grpc.aio.AioRpcError:
        async with _serving(tiny_dir) as addr:
            return await _generate_error(addr, message)

    error = asyncio.run(run())
    assert error.code() is grpc.StatusCode.UNAVAILABLE, error


def test_unknown_fields_and_unparsable_bytes_are_invalid_argument(tiny_dir: Path) -> None:
    known = _message().SerializeToString()
    sampling = tandem_pb2.SamplingParams(max_tokens=4).SerializeToString() + bytes([15 << 3, 1])
    nested = tandem_pb2.GenerateRequest(text="hi").SerializeToString() + bytes([5 << 3 | 2, len(sampling)])
    abort = tandem_pb2.AbortRequest(request_id="r").SerializeToString() + bytes([7 << 3 | 2, 1, 0x41])

    async def run() -> list[grpc.aio.AioRpcError]:
        async with _serving(tiny_dir) as addr:
            errors = [
                await _generate_error(addr, known + bytes([9 << 3, 5])),  # field 9, a varint
                await _generate_error(addr, nested + sampling),
                await _generate_error(addr, b"\x1a\x02\xff\xfe"),  # text that is not UTF-8
            ]
            async with grpc.aio.insecure_channel(addr) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as error:
                    await channel.unary_unary(ABORT)(abort, timeout=10)
            return [*errors, error.value]

    top, inner, garbled, aborted = asyncio.run(run())
    for error in (top, inner, garbled, aborted):
        assert error.code() is grpc.StatusCode.INVALID_ARGUMENT, error
        assert error.details().startswith("request:"), error.details()
    assert "unknown fields #9" in top.details()
    assert "unknown fields sampling.#15" in inner.details()
    assert "UTF-8" in garbled.details()
    assert "unknown fields #7" in aborted.details()


def test_a_request_over_max_request_bytes_is_resource_exhausted(tiny_dir: Path) -> None:
    async def run() -> grpc.aio.AioRpcError:
        async with _serving(tiny_dir, limits=EdgeLimits(max_request_bytes=4096)) as addr:
            return await _generate_error(addr, _message("a" * 5000))

    error = asyncio.run(run())
    assert error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED, error


async def _states_after_one_call(addr: str, watch_s: float) -> list[grpc.ChannelConnectivity]:
    """The channel's states from its first call (READY) on, for ``watch_s`` seconds."""
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = tandem_pb2_grpc.TandemStub(channel)
        assert not (await stub.Abort(tandem_pb2.AbortRequest(request_id="none"), timeout=10)).found
        states = [channel.get_state()]
        loop = asyncio.get_running_loop()
        deadline = loop.time() + watch_s
        while states[-1] is grpc.ChannelConnectivity.READY:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(channel.wait_for_state_change(states[-1]), deadline - loop.time())
            if loop.time() >= deadline:
                break
            states.append(channel.get_state())
        return states


def test_the_server_closes_an_idle_connection(tiny_dir: Path) -> None:
    async def run() -> tuple[list[Any], list[Any]]:
        async with _serving(tiny_dir, limits=EdgeLimits(max_connection_idle_s=0.3)) as short:
            closed = await _states_after_one_call(short, watch_s=20)
        async with _serving(tiny_dir) as default:  # 15 minutes: still open a second later
            kept = await _states_after_one_call(default, watch_s=1.0)
        return closed, kept

    closed, kept = asyncio.run(run())
    assert closed[0] is grpc.ChannelConnectivity.READY and closed[-1] is grpc.ChannelConnectivity.IDLE, closed
    assert kept == [grpc.ChannelConnectivity.READY]


def test_limits_name_the_setting_out_of_range() -> None:
    for limits, setting in [
        (EdgeLimits(max_requests_per_client=0), "max_requests_per_client"),
        (EdgeLimits(max_request_bytes=10), "max_request_bytes"),
        (EdgeLimits(keepalive_time_s=0), "keepalive_time_s"),
        (EdgeLimits(max_connection_age_s=-1), "max_connection_age_s"),
        (EdgeLimits(stream_interval=0), "stream_interval"),
    ]:
        with pytest.raises(ValueError, match=f"^{setting}:"):
            limits.check()
    options = dict(EdgeLimits(max_connection_idle_s=None, max_connection_age_s=30).server_options())
    assert (
        options["grpc.max_connection_idle_ms"] == 2**31 - 1
        and options["grpc.max_connection_age_ms"] == 30_000
    )


def test_token_files_name_their_clients() -> None:
    assert parse_client_tokens("  just-a-token \n", "f") == (ClientToken("default", "just-a-token"),)
    clients = parse_client_tokens("# who may call\nalice: tok-a\n\nbob:tok-b\n", "f")
    assert [(c.name, c.token) for c in clients] == [("alice", "tok-a"), ("bob", "tok-b")]
    assert "tok-a" not in repr(clients)  # secrets stay out of logs
    for text, why in [
        ("", "holds no token"),
        ("alice:a\nbob", "line 2: expected name:token"),
        ("alice:a\nalice:b", "client 'alice' is listed twice"),
        ("alice:a\nbob:a", "another client's too"),
        ("al ice:a\nbob:b", "client name"),
        ("alice:a b\nbob:c", "line 1: unknown field 'b'"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_client_tokens(text, "f")
    auth = BearerAuth(clients)
    assert auth.client_of([("authorization", "Bearer tok-b")]) == "bob"
    assert auth.client_of([("authorization", b"Bearer tok-a")]) == "alice"
    assert auth.client_of([("authorization", "Bearer tok-c")]) is None
    assert auth.client_of([("authorization", "tok-a")]) is None and auth.client_of(None) is None


def test_token_files_give_each_client_a_cache_salt_and_an_admin_flag(tmp_path: Path) -> None:
    """``name:token [cache_salt=SALT] [admin]``: a client without ``cache_salt`` gets a private
    salt of its own (from its name and its token: nobody else can name it), clients that name one
    share it; the old lines keep their meaning."""
    text = "alice:tok-a\nbob:tok-b admin\ncarol:tok-c cache_salt=team\ndave:tok-d cache_salt=team\n"
    alice, bob, carol, dave = parse_client_tokens(text, "f")
    assert (alice.admin, bob.admin, carol.admin) == (False, True, False)
    assert carol.cache_salt == dave.cache_salt
    assert len({alice.cache_salt, bob.cache_salt, carol.cache_salt}) == 3
    again = parse_client_tokens("alice:tok-a", "g")[0]
    assert alice.cache_salt == again.cache_salt  # every frontend with the file makes the same
    assert alice.cache_salt != parse_client_tokens("alice:tok-new", "g")[0].cache_salt
    assert "team" not in repr(carol) and "tok-a" not in (alice.cache_salt or "")
    (lone,) = parse_client_tokens("just-a-token\n", "f")
    assert lone.name == "default" and lone.cache_salt and not lone.admin
    for bad, why in [
        ("alice:a cache_salt=", "line 1: cache_salt of 'alice' is empty"),
        ("alice:a cache_salt=x\nbob:b cache_salt=" + "y" * 300, "line 2: cache_salt of 'bob' is longer"),
        ("alice:a admin=yes", "line 1: unknown field 'admin=yes'"),
        ("alice:a cache_salt=x cache_salt=y", "line 1: cache_salt is given twice"),
        ("alice:a salt=x", "line 1: unknown field 'salt=x'"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_client_tokens(bad, "f")
    from tandem.cli.serving import read_auth_tokens
    from tandem.wire.request_params import InvalidRequestError

    path = tmp_path / "tokens"
    path.write_text("alice:a cache_salt=\n")
    with pytest.raises(InvalidRequestError) as error:
        read_auth_tokens(path)
    assert error.value.field == "--auth-token-file" and f"{path}: line 1: cache_salt" in error.value.message


def test_cluster_status_shows_a_client_its_own_usage_unless_it_is_an_admin(tiny_dir: Path) -> None:
    tokens = "alice:tok-a\nbob:tok-b\nops:tok-ops admin\n"

    async def clients_seen(token: str | None, auth_token: str | None = tokens) -> list[str]:
        async with (
            _serving(tiny_dir, auth_token=auth_token) as addr,
            grpc.aio.insecure_channel(addr) as channel,
        ):
            call = channel.unary_unary(
                "/tandem.v1.Tandem/ClusterStatus",
                request_serializer=tandem_pb2.ClusterStatusRequest.SerializeToString,
                response_deserializer=tandem_pb2.ClusterStatusResponse.FromString,
            )
            metadata = (("authorization", f"Bearer {token}"),) if token else None
            reply = await call(tandem_pb2.ClusterStatusRequest(), metadata=metadata, timeout=10)
            return [c.client for c in reply.clients]

    assert asyncio.run(clients_seen("tok-a")) == ["alice"]
    assert asyncio.run(clients_seen("tok-b")) == ["bob"]
    assert asyncio.run(clients_seen("tok-ops")) == ["alice", "bob", "ops"]
    assert asyncio.run(clients_seen(None, None)) == []  # without auth: no table of clients to hide


def test_serving_beyond_loopback_without_tls_or_tokens_is_warned_about() -> None:
    for host in ("127.0.0.1", "::1", "localhost"):
        assert exposure_warning(host, tls=False, auth=False) is None
    assert exposure_warning("0.0.0.0", tls=True, auth=True) is None
    plain = exposure_warning("0.0.0.0", tls=False, auth=True)
    assert plain is not None and "without TLS" in plain and "plaintext" in plain
    open_ = exposure_warning("", tls=True, auth=False)
    assert open_ is not None and "every interface" in open_ and "without bearer tokens" in open_
    both = exposure_warning("10.1.2.3", tls=False, auth=False)
    assert both is not None and "without TLS and bearer tokens" in both


def test_a_temperature_below_the_greedy_bound_is_passed_on_as_greedy() -> None:
    from tandem.frontend.grpc_service import sampling_from_proto

    for temperature in (1.4e-45, 1e-38, 1e-6):  # float32 on the wire: its smallest positive first
        sampling = sampling_from_proto(tandem_pb2.SamplingParams(max_tokens=4, temperature=temperature), 300)
        assert sampling.temperature == 0.0 and sampling.greedy
    kept = sampling_from_proto(tandem_pb2.SamplingParams(max_tokens=4, temperature=0.5), 300)
    assert kept.temperature == 0.5 and not kept.greedy
