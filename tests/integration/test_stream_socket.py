"""A rank's pushes to a frontend: actor calls first, then the frontend's stream socket once its
endpoint has come, with every batch arriving once and in order across the switch; a wrong secret
is refused; a frontend that is gone makes ``send`` answer False."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from tandem.cluster.outbox import RayOutbox
from tandem.cluster.ray_bootstrap import init_ray, shutdown_ray
from tandem.cluster.stream_socket import SocketStream
from tandem.frontend.stream_listener import StreamListener


@ray.remote
class _Frontend:
    """What the outbox needs of a frontend: ``push_stream`` and ``stream_endpoint``."""

    def __init__(self) -> None:
        self.received: list[tuple[str, Any]] = []
        self.listener = StreamListener(lambda batch: self.received.append(("socket", batch)))

    async def start(self) -> None:
        await self.listener.start("127.0.0.1")

    async def push_stream(self, batch: Any) -> None:
        self.received.append(("call", batch))

    async def stream_endpoint(self) -> tuple[str, int, bytes] | None:
        return self.listener.endpoint()

    async def got(self) -> list[tuple[str, Any]]:
        return self.received

    async def refused(self) -> int:
        return self.listener.refused


@pytest.fixture(scope="module")
def ray_local() -> Iterator[None]:
    init_ray(num_cpus=2)
    yield
    shutdown_ray()


def _wait_for(frontend: Any, count: int) -> list[tuple[str, Any]]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        got = ray.get(frontend.got.remote())
        if len(got) >= count:
            return got
        time.sleep(0.05)
    raise AssertionError(f"{len(got)} of {count} batches arrived")


def test_pushes_move_to_the_socket_and_arrive_once_in_order(ray_local: None) -> None:
    frontend = _Frontend.options(name="fe-stream-test").remote()  # type: ignore[attr-defined]
    ray.get(frontend.start.remote())
    outbox = RayOutbox("rank-x")
    for i in range(300):
        assert outbox.send("fe-stream-test", "push_stream", {"seq": i, "tokens": list(range(i % 7))})
        assert outbox.flush() == []
        time.sleep(0.001)
    got = _wait_for(frontend, 300)
    assert [batch["seq"] for _, batch in got] == list(range(300))
    paths = [path for path, _ in got]
    assert paths[0] == "call" and paths[-1] == "socket"
    switch = paths.index("socket")
    assert set(paths[switch:]) == {"socket"}  # no actor call after the switch

    ray.kill(frontend)  # gone: the socket fails and the outbox says so
    deadline, failed = time.monotonic() + 30, False
    while time.monotonic() < deadline and not failed:
        failed = not outbox.send("fe-stream-test", "push_stream", {"seq": -1}) or bool(outbox.flush())
        time.sleep(0.05)
    assert failed


def test_a_connection_without_the_secret_is_refused() -> None:
    received: list[Any] = []

    async def run() -> int:
        listener = StreamListener(received.append)
        host, port = await listener.start("127.0.0.1")
        loop = asyncio.get_running_loop()
        wrong = await loop.run_in_executor(None, lambda: SocketStream(host, port, b"x" * 16))
        with contextlib.suppress(ConnectionError):  # the listener may have closed it already
            wrong.send({"seq": 1})
        good = await loop.run_in_executor(None, lambda: SocketStream(host, port, listener.secret))
        good.send({"seq": 2})
        for _ in range(200):
            if received and listener.refused:
                break
            await asyncio.sleep(0.01)
        wrong.close()
        good.close()
        await listener.stop()
        return listener.refused

    assert asyncio.run(run()) == 1
    assert received == [{"seq": 2}]


def test_a_frontend_that_stops_reading_is_found_backed_up() -> None:
    server = socket.create_server(("127.0.0.1", 0))
    host, port = server.getsockname()
    stream = SocketStream(host, port, b"s" * 16, max_buffered_bytes=1 << 20)
    peer, _ = server.accept()  # accepted, never read
    try:
        with pytest.raises(ConnectionError, match="wait for the frontend"):
            for _ in range(1000):
                stream.send(b"\0" * (64 << 10))
    finally:
        stream.close()
        peer.close()
        server.close()


def test_a_closed_frontend_socket_is_found_before_a_batch_is_written() -> None:
    """A restarted frontend must not lose its first batch into its dead predecessor's socket."""
    server = socket.create_server(("127.0.0.1", 0))
    host, port = server.getsockname()
    stream = SocketStream(host, port, b"s" * 16)
    peer, _ = server.accept()
    assert peer.recv(16) == b"s" * 16  # read what came: the close is a clean FIN
    peer.close()
    try:
        deadline = time.monotonic() + 10
        with pytest.raises(ConnectionResetError, match="closed its stream socket"):
            while time.monotonic() < deadline:  # the FIN is seen as soon as it arrives
                stream._check_open()
                time.sleep(0.01)
    finally:
        stream.close()
        server.close()
