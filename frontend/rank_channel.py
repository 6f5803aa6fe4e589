"""The frontend's end of a decode rank's submit connection (``cluster/submit_listener.py``).

:meth:`RankChannel.submit` writes one frame and returns a future the answer settles: ``None``
once the rank has taken the requests, :class:`SubmitRefused` when it refused them (``draining``
says whether to route them again), ``ConnectionError`` when the connection ended first (the rank
may or may not hold them: its tokens for a request no stream waits for get it aborted as an
orphan's). Answers come in the order of the submits, from one reader task on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from typing import Any

import ray

from tandem.engine.rank_loop import RankDraining
from tandem.wire.framing import LENGTH_BYTES, FrameTooLarge, frame, frame_length, unframe

log = logging.getLogger(__name__)


class SubmitRefused(Exception):
    """The decode rank refused a submit; ``draining``: because it is being drained."""

    def __init__(self, why: str, draining: bool) -> None:
        super().__init__(why)
        self.draining = draining


# what a submit's answer raises: an actor call's error, a refusal or a lost connection (the socket)
SUBMIT_ERRORS = (ray.exceptions.RayError, SubmitRefused, ConnectionError)


def refusal(error: Exception) -> tuple[bool, str]:
    """Whether a decode rank refused a submit because it is being drained, and why it refused."""
    if isinstance(error, SubmitRefused):
        return error.draining, str(error)
    cause = getattr(error, "cause", None)
    if isinstance(cause, RankDraining):
        return True, str(cause)
    return False, last_line(error)


def last_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__


class RankChannel:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer
        self._pending: dict[int, asyncio.Future[None]] = {}
        self._seq = 0
        self._closed = False
        self._task = asyncio.get_running_loop().create_task(self._read_answers())

    @classmethod
    async def open(cls, endpoint: tuple[str, int, bytes], timeout_s: float = 2.0) -> RankChannel:
        """Connect to a rank's ``submit_endpoint()``; ``OSError`` or ``TimeoutError`` when it
        cannot be reached."""
        host, port, secret = endpoint
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(secret)
        return cls(reader, writer)

    @property
    def is_open(self) -> bool:
        return not self._closed

    @property
    def waiting(self) -> int:
        """Submits sent and not answered yet."""
        return len(self._pending)

    def submit(self, items: list[Any]) -> asyncio.Future[None]:
        """Send ``items`` to the rank; the future of its answer. ``ConnectionError`` at once
        when the connection has ended."""
        if self._closed:
            raise ConnectionError("the submit connection to the decode rank is closed")
        self._seq += 1
        answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[self._seq] = answer
        self._writer.write(frame((self._seq, items)))
        return answer

    def close(self) -> None:
        self._end("the frontend closed the submit connection")
        self._task.cancel()

    async def _read_answers(self) -> None:
        why = "the decode rank closed the submit connection"
        try:
            while True:
                try:
                    length = frame_length(await self._reader.readexactly(LENGTH_BYTES))
                except FrameTooLarge as exc:
                    why = f"the decode rank sent {exc}"
                    return
                seq, refusal = unframe(await self._reader.readexactly(length))
                answer = self._pending.pop(seq, None)
                if answer is None or answer.done():
                    continue
                if refusal is None:
                    answer.set_result(None)
                else:
                    draining, reason = refusal
                    answer.set_exception(SubmitRefused(reason, draining))
        except (asyncio.IncompleteReadError, OSError) as exc:
            why = f"{why}: {exc}" if isinstance(exc, OSError) else why
        finally:
            self._end(why)

    def _end(self, why: str) -> None:
        if not self._closed:
            self._closed = True
            self._writer.close()
        pending, self._pending = self._pending, {}
        for answer in pending.values():
            if not answer.done():
                answer.set_exception(ConnectionError(why))
                with contextlib.suppress(Exception):
                    answer.exception()  # a waiter that was cancelled meanwhile reads none
