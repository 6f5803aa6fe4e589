"""A rank's channel server and a frontend's channel to it, on loopback (``wire/channel.py``).

Submits arrive in order and are answered; a refusal is an answer that names why (a draining
rank's says so) and leaves the channel up; a wrong secret or hello, a frame too large or not of
the protocol closes that connection only and fails what the frontend waited on; closing either
end fails the waiting submits at once. The rank's stream batches come on the same channel, in
order, between the answers; an abort sent after a submit reaches the rank after it; a subscribe
gets its snapshot before its answer, then the rank's KV events; a frontend that stops reading,
closes, or opens a new channel under its name is found by the rank's sends.
"""

from __future__ import annotations

import asyncio
import pickle
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tandem.cluster.channel_server import ChannelServer
from tandem.engine.rank_loop import RankDraining
from tandem.frontend.rank_channel import RankChannel, SubmitRefused, refusal
from tandem.wire.channel import Endpoint, Hello
from tandem.wire.framing import LENGTH_BYTES, frame
from tandem.wire.kv_events import BlockStored, KVEventBatch
from tandem.wire.messages import RankId, StreamBatch, TokenDelta
from tandem.wire.request_params import InvalidRequestError

RANK = RankId("decode0", 0)


def _server(
    submit: Callable[[list[Any]], None], abort: Callable[[list[str]], None] = lambda ids: None, **kwargs: Any
) -> ChannelServer:
    return ChannelServer("127.0.0.1", submit, abort, **kwargs)


def _wait(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


async def _open(server: ChannelServer, frontend: str = "fe", **kwargs: Any) -> RankChannel:
    return await RankChannel.open(
        server.endpoint(), frontend, kwargs.pop("on_batch", lambda b: None), **kwargs
    )


def _batch(seq: int) -> StreamBatch:
    return StreamBatch.of(RANK, (TokenDelta(f"r{seq}", seq, (seq,), (float(seq),), (0.0,)),))


def test_submits_arrive_in_order_and_are_answered() -> None:
    taken: list[Any] = []
    server = _server(taken.extend)

    async def run() -> None:
        channel = await _open(server)
        answers = [channel.submit([f"r{i}", f"s{i}"]) for i in range(50)]  # type: ignore[list-item]
        assert await asyncio.gather(*answers) == [None] * 50
        channel.close()

    try:
        asyncio.run(run())
        assert taken == [x for i in range(50) for x in (f"r{i}", f"s{i}")]
        assert server.submits == 50 and server.refused == 0
    finally:
        server.close()


def test_a_refusal_is_an_answer_and_the_connection_stays_up() -> None:
    def submit(items: list[Any]) -> None:
        if items == ["drain"]:
            raise RankDraining("decode-0:0")
        if items == ["bad"]:
            raise InvalidRequestError("sampling.max_tokens", "must be at least 1, got 0")

    server = _server(submit)

    async def run() -> tuple[BaseException, BaseException]:
        channel = await _open(server)
        drained = await asyncio.gather(channel.submit(["drain"]), return_exceptions=True)  # type: ignore[list-item]
        bad = await asyncio.gather(channel.submit(["bad"]), return_exceptions=True)  # type: ignore[list-item]
        assert await channel.submit(["good"]) is None and channel.is_open  # type: ignore[list-item]
        channel.close()
        return drained[0], bad[0]

    try:
        drained, bad = asyncio.run(run())
    finally:
        server.close()
    assert isinstance(drained, SubmitRefused) and drained.draining
    assert refusal(drained)[0] is True
    assert isinstance(bad, SubmitRefused) and not bad.draining
    again, why = refusal(bad)
    assert not again and "sampling.max_tokens" in why and "InvalidRequestError" in why
    # a channel that ended before the answer: the rank holds nothing for it, route it again
    assert refusal(ConnectionError("the rank closed the channel")) == (True, "the rank closed the channel")


def test_a_connection_without_the_secret_is_closed_unanswered() -> None:
    taken: list[Any] = []
    server = _server(taken.extend)
    endpoint = server.endpoint()

    async def run() -> BaseException:
        wrong = Endpoint(endpoint.host, endpoint.port, bytes(len(endpoint.secret)))
        channel = await RankChannel.open(wrong, "fe", lambda b: None)
        got = await asyncio.gather(channel.submit(["x"]), return_exceptions=True)  # type: ignore[list-item]
        assert not channel.is_open
        return got[0]

    try:
        error = asyncio.run(run())
        _wait(lambda: server.refused == 1)
    finally:
        server.close()
    assert isinstance(error, ConnectionError) and taken == []


@pytest.mark.parametrize("bad", ["no_hello", "too_large", "not_a_pickle", "not_a_submit"])
def test_a_bad_frame_closes_its_connection_only(bad: str) -> None:
    taken: list[Any] = []
    server = _server(taken.extend, max_frame_bytes=1 << 16)
    endpoint = server.endpoint()
    try:
        with socket.create_connection((endpoint.host, endpoint.port), timeout=10) as sock:
            sock.sendall(endpoint.secret)
            if bad == "no_hello":  # a submit where the hello belongs
                sock.sendall(frame(("seq", "items")))
            else:
                sock.sendall(frame(Hello("fe-raw")))
                if bad == "too_large":
                    sock.sendall((1 << 20).to_bytes(LENGTH_BYTES, "big"))
                elif bad == "not_a_pickle":
                    sock.sendall((4).to_bytes(LENGTH_BYTES, "big") + b"\x00\x01\x02\x03")
                else:
                    sock.sendall(frame(("seq", "items")))
            assert sock.recv(1) == b""  # closed by the rank, unanswered
        _wait(lambda: server.refused == 1)
        assert server.connection("fe-raw") is None

        async def still_serves() -> None:  # a second frontend's connection is not touched
            channel = await _open(server)
            assert await channel.submit(["ok"]) is None  # type: ignore[list-item]
            channel.close()

        asyncio.run(still_serves())
        assert taken == ["ok"]
    finally:
        server.close()


def test_closing_either_end_fails_the_submits_waiting_on_it() -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(items: list[Any]) -> None:
        entered.set()
        release.wait(10)

    server = _server(slow)
    closed: list[str] = []

    async def frontend_closes() -> BaseException:
        channel = await _open(server, on_close=closed.append)
        answer = channel.submit(["a"])  # type: ignore[list-item]
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        channel.close()
        got = await asyncio.gather(answer, return_exceptions=True)
        with pytest.raises(ConnectionError):
            channel.submit(["b"])  # type: ignore[list-item]
        return got[0]

    async def rank_closes(other: ChannelServer) -> BaseException:
        channel = await _open(other, on_close=closed.append)
        answer = channel.submit(["a"])  # type: ignore[list-item]
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        other.close()
        return (await asyncio.gather(answer, return_exceptions=True))[0]

    try:
        assert isinstance(asyncio.run(frontend_closes()), ConnectionError)
        assert closed == []  # the frontend's own close is not a loss
    finally:
        release.set()
        server.close()
    entered.clear()
    release.clear()
    other = _server(slow)
    try:
        assert isinstance(asyncio.run(asyncio.wait_for(rank_closes(other), 10)), ConnectionError)
        assert len(closed) == 1 and "closed the channel" in closed[0]  # the rank's close is heard once
    finally:
        release.set()
        other.close()
    with pytest.raises(OSError):  # the listening socket is closed
        socket.create_connection(other.address, timeout=2).close()


def test_stream_batches_come_on_the_channel_in_order_between_the_answers() -> None:
    """The rank's loop thread sends batches while the connection's thread answers submits: every
    batch arrives once, in order, and every answer reaches its submit."""
    server = _server(lambda items: None)
    got: list[int] = []

    def stream(count: int) -> None:
        for i in range(count):
            while not server.send_to("fe", _batch(i)):  # until the frontend's hello is in
                time.sleep(0.001)
            assert server.flush() == []

    async def run() -> None:
        channel = await _open(server, on_batch=lambda b: got.append(b.start_indices[0]))
        loop = asyncio.get_running_loop()
        sending = loop.run_in_executor(None, stream, 2000)
        answers = []
        for i in range(200):
            answers.append(channel.submit([f"r{i}"]))  # type: ignore[list-item]
            await asyncio.sleep(0)
        assert await asyncio.gather(*answers) == [None] * 200
        await sending
        while len(got) < 2000:
            await asyncio.sleep(0.01)
        assert channel.batches == 2000
        channel.close()

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        server.close()
    assert got == list(range(2000))


def test_an_abort_sent_after_a_submit_reaches_the_rank_after_it() -> None:
    seen: list[str] = []
    server = _server(
        lambda items: seen.extend(f"submit {i}" for i in items), lambda ids: seen.append(f"abort {ids[0]}")
    )

    async def run() -> None:
        channel = await _open(server)
        for i in range(100):
            channel.submit([f"r{i}"])  # type: ignore[list-item]
            channel.abort([f"r{i}"])  # not waiting for the answer: the channel keeps the order
        await channel.submit(["last"])  # type: ignore[list-item]
        channel.close()

    try:
        asyncio.run(run())
    finally:
        server.close()
    assert seen == [x for i in range(100) for x in (f"submit r{i}", f"abort r{i}")] + ["submit last"]


def test_a_subscribe_gets_its_snapshot_before_its_answer_then_the_ranks_events() -> None:
    subscribed: list[str] = []

    def subscribe(frontend: str) -> KVEventBatch:
        subscribed.append(frontend)
        return KVEventBatch(RANK, 1, 0, True, [BlockStored((1,), None, 8)])

    server = ChannelServer("127.0.0.1", lambda items: None, lambda ids: None, subscribe)
    plain = _server(lambda items: None)  # a rank that publishes none refuses
    got: list[KVEventBatch] = []

    async def run() -> BaseException:
        channel = await _open(server, "fe-kv", on_kv_events=got.append)
        await channel.subscribe()
        assert [b.seq for b in got] == [0]  # the snapshot came first
        assert server.send_to("fe-kv", KVEventBatch(RANK, 1, 1, False, [BlockStored((2,), 1, 8)]))
        while len(got) < 2:
            await asyncio.sleep(0.01)
        channel.close()
        other = await _open(plain)
        refused = (await asyncio.gather(other.subscribe(), return_exceptions=True))[0]
        assert other.is_open  # a refusal, not the end of the channel
        other.close()
        return refused

    try:
        refused = asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        server.close()
        plain.close()
    assert subscribed == ["fe-kv"] and [b.seq for b in got] == [0, 1]
    assert isinstance(refused, SubmitRefused) and "publishes no KV events" in str(refused)


def _raw_frontend(server: ChannelServer, name: str) -> socket.socket:
    endpoint = server.endpoint()
    sock = socket.create_connection((endpoint.host, endpoint.port), timeout=10)
    sock.sendall(endpoint.secret + frame(Hello(name)))
    _wait(lambda: server.connection(name) is not None)
    return sock


def test_a_frontend_that_stops_reading_is_found_backed_up() -> None:
    server = _server(lambda items: None, max_buffered_bytes=1 << 20)
    sock = _raw_frontend(server, "fe-stalled")  # never reads
    try:
        sent = 0
        while server.send_to("fe-stalled", b"\0" * (64 << 10)) and sent < 1000:
            sent += 1
        assert sent < 1000  # refused once 1 MiB waited unread, long before 64 MiB
        assert server.connection("fe-stalled") is None
    finally:
        sock.close()
        server.close()


def test_a_frontend_that_closed_or_reconnected_is_found_before_its_next_batch() -> None:
    """A frontend that closes its channel is gone (``send_to`` False: what the rank holds for it
    ends); one that opens a new channel under its name gets its batches on the new one."""
    server = _server(lambda items: None)
    first = _raw_frontend(server, "fe")
    old = server.connection("fe")
    second = _raw_frontend(server, "fe")
    try:
        _wait(lambda: old is not None and not old.is_open)  # replaced
        assert server.send_to("fe", {"seq": 1})
        second.settimeout(10)
        head = second.recv(LENGTH_BYTES, socket.MSG_WAITALL)
        body = second.recv(int.from_bytes(head, "big"), socket.MSG_WAITALL)
        assert pickle.loads(body) == {"seq": 1}
        second.close()
        _wait(lambda: server.connection("fe") is None)
        assert not server.send_to("fe", {"seq": 2})
    finally:
        first.close()
        second.close()
        server.close()


def test_frames_are_length_prefixed_pickles() -> None:
    data = frame((7, ["x"]))
    assert int.from_bytes(data[:LENGTH_BYTES], "big") == len(data) - LENGTH_BYTES
    assert pickle.loads(data[LENGTH_BYTES:]) == (7, ["x"])
