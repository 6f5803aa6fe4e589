"""The frontend's end of the ranks' token streams: one TCP connection per decode rank.

A rank's step loop pushes a batch (its tokens and results for this frontend) every iteration; as
an actor call that costs the rank a few hundred microseconds of Python per push and the frontend
the call's dispatch. Over this listener a push is one length-prefixed pickle on a socket the rank
keeps open. Frames::

    rank -> frontend, once:  SECRET (16 bytes: the frontend's, handed out by its actor)
    rank -> frontend, each:  LENGTH (8 bytes, big-endian) PAYLOAD (pickle of a StreamBatch)

A connection that does not open with the secret is closed unread: only processes that can call
the frontend's actor (members of its Ray cluster) learn it. Batches of one connection arrive in
the order they were sent; each is handed to ``on_batch`` on the event loop, as ``push_stream``
hands an actor call's.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import secrets
from collections.abc import Callable
from typing import Any

from tandem.wire.framing import LENGTH_BYTES, FrameTooLarge, frame_length, unframe

log = logging.getLogger(__name__)

SECRET_BYTES = 16


class StreamListener:
    def __init__(self, on_batch: Callable[[Any], None]) -> None:
        self.on_batch = on_batch
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._server: asyncio.Server | None = None
        self._connections: set[asyncio.StreamWriter] = set()
        self.address: tuple[str, int] | None = None
        self.refused = 0  # connections closed for a wrong secret or a bad frame

    async def start(self, host: str) -> tuple[str, int]:
        """Listen on ``host`` (a port the OS picks); the address ranks connect to."""
        self._server = await asyncio.start_server(self._serve, host, 0)
        port = self._server.sockets[0].getsockname()[1]
        self.address = (host, port)
        return self.address

    def endpoint(self) -> tuple[str, int, bytes] | None:
        """What a rank needs to connect: host, port and the secret (None before ``start``)."""
        return None if self.address is None else (*self.address, self.secret)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            for writer in list(self._connections):
                writer.close()
            await self._server.wait_closed()
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._connections.add(writer)
        try:
            hello = await reader.readexactly(SECRET_BYTES)
            if not hmac.compare_digest(hello, self.secret):
                self.refused += 1
                return
            while True:
                try:
                    length = frame_length(await reader.readexactly(LENGTH_BYTES))
                except FrameTooLarge as exc:
                    self.refused += 1
                    log.warning("stream listener: %s; closing the connection", exc)
                    return
                batch = unframe(await reader.readexactly(length))
                try:
                    self.on_batch(batch)
                except Exception:  # one bad batch is that batch's problem, not the stream's
                    log.exception("stream listener: a pushed batch failed")
        except (asyncio.IncompleteReadError, ConnectionError):
            pass  # the rank went away or closed: its requests end through the membership
        finally:
            self._connections.discard(writer)
            writer.close()
