"""A decode rank's submit socket and the frontend's channel to it, on loopback: submits arrive in
order and are answered; a refusal is an answer that names why (a draining rank's says so) and
leaves the connection up; a wrong secret, a frame too large or not a pickle closes it and fails
what the frontend waited on; closing either end fails the waiting submits at once."""

from __future__ import annotations

import asyncio
import pickle
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from tandem.cluster.submit_listener import SubmitListener
from tandem.engine.rank_loop import RankDraining
from tandem.frontend.rank_channel import RankChannel, SubmitRefused, refusal
from tandem.wire.framing import LENGTH_BYTES, frame
from tandem.wire.request_params import InvalidRequestError


def _listener(submit: Callable[[list[Any]], None], **kwargs: Any) -> SubmitListener:
    return SubmitListener(submit, "127.0.0.1", **kwargs)


def _wait(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_submits_arrive_in_order_and_are_answered() -> None:
    taken: list[Any] = []
    listener = _listener(taken.extend)

    async def run() -> None:
        channel = await RankChannel.open(listener.endpoint())
        answers = [channel.submit([f"r{i}", f"s{i}"]) for i in range(50)]
        assert await asyncio.gather(*answers) == [None] * 50
        channel.close()

    try:
        asyncio.run(run())
        assert taken == [x for i in range(50) for x in (f"r{i}", f"s{i}")]
        assert listener.submits == 50 and listener.refused == 0
    finally:
        listener.close()


def test_a_refusal_is_an_answer_and_the_connection_stays_up() -> None:
    def submit(items: list[Any]) -> None:
        if items == ["drain"]:
            raise RankDraining("decode-0:0")
        if items == ["bad"]:
            raise InvalidRequestError("sampling.max_tokens", "must be at least 1, got 0")

    listener = _listener(submit)

    async def run() -> tuple[BaseException, BaseException]:
        channel = await RankChannel.open(listener.endpoint())
        drained = await asyncio.gather(channel.submit(["drain"]), return_exceptions=True)
        bad = await asyncio.gather(channel.submit(["bad"]), return_exceptions=True)
        assert await channel.submit(["good"]) is None and channel.is_open
        channel.close()
        return drained[0], bad[0]

    try:
        drained, bad = asyncio.run(run())
    finally:
        listener.close()
    assert isinstance(drained, SubmitRefused) and drained.draining
    assert refusal(drained)[0] is True
    assert isinstance(bad, SubmitRefused) and not bad.draining
    draining, why = refusal(bad)
    assert not draining and "sampling.max_tokens" in why and "InvalidRequestError" in why


def test_a_connection_without_the_secret_is_closed_unanswered() -> None:
    taken: list[Any] = []
    listener = _listener(taken.extend)
    host, port, secret = listener.endpoint()

    async def run() -> BaseException:
        channel = await RankChannel.open((host, port, bytes(len(secret))))
        got = await asyncio.gather(channel.submit(["x"]), return_exceptions=True)
        assert not channel.is_open
        return got[0]

    try:
        error = asyncio.run(run())
        _wait(lambda: listener.refused == 1)
    finally:
        listener.close()
    assert isinstance(error, ConnectionError) and taken == []


@pytest.mark.parametrize("bad", ["too_large", "not_a_pickle", "not_a_submit"])
def test_a_bad_frame_closes_its_connection_only(bad: str) -> None:
    taken: list[Any] = []
    listener = _listener(taken.extend, max_frame_bytes=1 << 16)
    host, port, secret = listener.endpoint()
    try:
        with socket.create_connection((host, port), timeout=10) as sock:
            sock.sendall(secret)
            if bad == "too_large":
                sock.sendall((1 << 20).to_bytes(LENGTH_BYTES, "big"))
            elif bad == "not_a_pickle":
                sock.sendall((4).to_bytes(LENGTH_BYTES, "big") + b"\x00\x01\x02\x03")
            else:
                sock.sendall(frame(("seq", "items")))
            assert sock.recv(1) == b""  # closed by the rank, unanswered
        _wait(lambda: listener.refused == 1)

        async def still_serves() -> None:  # a second frontend's connection is not touched
            channel = await RankChannel.open(listener.endpoint())
            assert await channel.submit(["ok"]) is None
            channel.close()

        asyncio.run(still_serves())
        assert taken == ["ok"]
    finally:
        listener.close()


def test_closing_either_end_fails_the_submits_waiting_on_it() -> None:
    entered, release = threading.Event(), threading.Event()

    def slow(items: list[Any]) -> None:
        entered.set()
        release.wait(10)

    listener = _listener(slow)

    async def frontend_closes() -> BaseException:
        channel = await RankChannel.open(listener.endpoint())
        answer = channel.submit(["a"])
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        channel.close()
        got = await asyncio.gather(answer, return_exceptions=True)
        with pytest.raises(ConnectionError):
            channel.submit(["b"])
        return got[0]

    async def rank_closes(other: SubmitListener) -> BaseException:
        channel = await RankChannel.open(other.endpoint())
        answer = channel.submit(["a"])
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        other.close()
        return (await asyncio.gather(answer, return_exceptions=True))[0]

    try:
        assert isinstance(asyncio.run(frontend_closes()), ConnectionError)
    finally:
        release.set()
        listener.close()
    entered.clear()
    release.clear()
    other = _listener(slow)
    try:
        assert isinstance(asyncio.run(asyncio.wait_for(rank_closes(other), 10)), ConnectionError)
    finally:
        release.set()
        other.close()
    with pytest.raises(OSError):  # the listening socket is closed
        socket.create_connection(other.address, timeout=2).close()


def test_frames_are_length_prefixed_pickles() -> None:
    data = frame((7, ["x"]))
    assert int.from_bytes(data[:LENGTH_BYTES], "big") == len(data) - LENGTH_BYTES
    assert pickle.loads(data[LENGTH_BYTES:]) == (7, ["x"])
