"""The frontend's end of a rank's channel (``wire/channel.py``; ``cluster/channel_server.py`` is
the other end).

:meth:`RankChannel.submit` writes one frame and returns a future the answer settles: ``None``
once the rank has taken the requests, :class:`SubmitRefused` when it refused them (``draining``
says whether to route them again), ``ConnectionError`` when the channel ended first (the rank
may or may not hold them; it ends what it holds for a frontend whose channel is gone). Answers
come in the order of the submits; the rank's stream batches come on the same channel and go to
``on_batch``, its KV events (after :meth:`RankChannel.subscribe`) to ``on_kv_events``, all from
one reader task on the event loop. When the channel ends, ``on_close`` hears why (once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Callable
from typing import Any

from tandem.engine.rank_loop import RankDraining
from tandem.wire.channel import Abort, Answer, Endpoint, Hello, Submit, Subscribe
from tandem.wire.framing import LENGTH_BYTES, FrameTooLarge, frame, frame_length, unframe
from tandem.wire.kv_events import KVEventBatch
from tandem.wire.messages import RankId, RankRequest, StreamBatch

log = logging.getLogger(__name__)


class SubmitRefused(Exception):
    """The decode rank refused a submit; ``draining``: because it is being drained."""

    def __init__(self, why: str, draining: bool) -> None:
        super().__init__(why)
        self.draining = draining


class RankNotReachable(ConnectionError):
    """No channel to the rank is open (yet, or any more): the router routes the request again."""

    def __init__(self, rank: RankId) -> None:
        super().__init__(f"no channel to rank {rank} is open")
        self.rank = rank


# what a submit's answer raises: a refusal or a channel that ended before the answer
SUBMIT_ERRORS = (SubmitRefused, ConnectionError)


def refusal(error: Exception) -> tuple[bool, str]:
    """Whether a submit that failed with ``error`` may be routed again, and why it failed: yes
    when the rank refused it because it is being drained, or when its channel ended before the
    answer (a rank ends what it holds for a frontend whose channel is gone, so the request is
    nowhere)."""
    if isinstance(error, SubmitRefused):
        return error.draining, str(error)
    if isinstance(error, RankDraining | ConnectionError):
        return True, str(error)
    return False, last_line(error)


def last_line(error: Exception) -> str:
    lines = str(error).strip().splitlines()
    return lines[-1] if lines else type(error).__name__


class RankChannel:
    def __init__(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        on_batch: Callable[[StreamBatch], None],
        on_close: Callable[[str], None] | None = None,
        on_kv_events: Callable[[KVEventBatch], None] | None = None,
    ) -> None:
        self._reader, self._writer = reader, writer
        self._on_batch, self._on_close, self._on_kv_events = on_batch, on_close, on_kv_events
        self._pending: dict[int, asyncio.Future[None]] = {}
        self._seq = 0
        self._closed = False
        self.batches = 0  # stream batches received
        self._task = asyncio.get_running_loop().create_task(self._read())

    @classmethod
    async def open(
        cls,
        endpoint: Endpoint,
        frontend: str,
        on_batch: Callable[[StreamBatch], None],
        on_close: Callable[[str], None] | None = None,
        on_kv_events: Callable[[KVEventBatch], None] | None = None,
        timeout_s: float = 2.0,
    ) -> RankChannel:
        """Open a channel to a rank's ``channel_endpoint()`` as ``frontend`` (the rank streams
        that frontend's batches on it); ``OSError`` or ``TimeoutError`` when it cannot be
        reached."""
        reader, writer = await asyncio.wait_for(
            asyncio.open_connection(endpoint.host, endpoint.port), timeout_s
        )
        sock = writer.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        writer.write(endpoint.secret + frame(Hello(frontend)))
        return cls(reader, writer, on_batch, on_close, on_kv_events)

    @property
    def is_open(self) -> bool:
        return not self._closed

    @property
    def waiting(self) -> int:
        """Submits sent and not answered yet."""
        return len(self._pending)

    def send(self, message: Any) -> None:
        if self._closed:
            raise ConnectionError("the channel to the rank is closed")
        self._writer.write(frame(message))

    def submit(self, requests: list[RankRequest]) -> asyncio.Future[None]:
        """Send ``requests`` to the rank; the future of its answer. ``ConnectionError`` at once
        when the channel has ended."""
        return self._ask(lambda seq: Submit(seq, tuple(requests)))

    def subscribe(self) -> asyncio.Future[None]:
        """Ask for the rank's KV events; its snapshot comes to ``on_kv_events`` before the
        answer settles the future, its batches after."""
        return self._ask(Subscribe)

    def _ask(self, message: Callable[[int], Any]) -> asyncio.Future[None]:
        if self._closed:
            raise ConnectionError("the channel to the rank is closed")
        self._seq += 1
        answer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending[self._seq] = answer
        self._writer.write(frame(message(self._seq)))
        return answer

    def abort(self, request_ids: list[str]) -> None:
        """Tell the rank to abort these requests; nothing when the channel has ended (the rank
        ends what it holds for this frontend then)."""
        if not self._closed:
            self._writer.write(frame(Abort(tuple(request_ids))))

    def close(self) -> None:
        """End the channel from this side (``on_close`` is not called)."""
        self._on_close = None
        self._end("the frontend closed the channel")
        self._task.cancel()

    async def _read(self) -> None:
        why = "the rank closed the channel"
        try:
            while True:
                try:
                    length = frame_length(await self._reader.readexactly(LENGTH_BYTES))
                except FrameTooLarge as exc:
                    why = f"the rank sent {exc}"
                    return
                message = unframe(await self._reader.readexactly(length))
                if isinstance(message, Answer):
                    self._answer(message)
                elif isinstance(message, StreamBatch | KVEventBatch):
                    self.batches += 1
                    try:
                        if isinstance(message, StreamBatch):
                            self._on_batch(message)
                        elif self._on_kv_events is not None:
                            self._on_kv_events(message)
                    except Exception:  # one bad batch is that batch's problem, not the channel's
                        log.exception("rank channel: a pushed batch failed")
                else:
                    why = f"the rank sent a {type(message).__name__} frame"
                    return
        except (asyncio.IncompleteReadError, OSError) as exc:
            why = f"{why}: {exc}" if isinstance(exc, OSError) else why
        finally:
            self._end(why)

    def _answer(self, message: Answer) -> None:
        answer = self._pending.pop(message.seq, None)
        if answer is None or answer.done():
            return
        if message.refusal is None:
            answer.set_result(None)
        else:
            draining, reason = message.refusal
            answer.set_exception(SubmitRefused(reason, draining))

    def _end(self, why: str) -> None:
        first = not self._closed
        if first:
            self._closed = True
            self._writer.close()
        pending, self._pending = self._pending, {}
        for answer in pending.values():
            if not answer.done():
                answer.set_exception(ConnectionError(why))
                with contextlib.suppress(Exception):
                    answer.exception()  # a waiter that was cancelled meanwhile reads none
        if first and self._on_close is not None:
            self._on_close(why)
