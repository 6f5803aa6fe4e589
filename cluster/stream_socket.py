"""A rank's end of one token stream to a frontend (``frontend/stream_listener.py`` is the other).

The step loop never blocks on it: the socket is non-blocking, a frame the kernel does not take at
once waits in this side's buffer and goes out at the next ``flush`` (each loop iteration), and a
frontend that stops reading for long is treated as gone once ``max_buffered_bytes`` wait here.
"""

from __future__ import annotations

import socket
from typing import Any

from tandem.wire.framing import frame


class StreamBackedUp(ConnectionError):
    """The frontend has not taken the bytes already sent to it."""


class SocketStream:
    def __init__(
        self,
        host: str,
        port: int,
        secret: bytes,
        connect_timeout_s: float = 2.0,
        max_buffered_bytes: int = 64 << 20,
    ) -> None:
        self.max_buffered_bytes = max_buffered_bytes
        self._sock = socket.create_connection((host, port), timeout=connect_timeout_s)
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.sendall(secret)
        self._sock.setblocking(False)
        self._pending = bytearray()

    @property
    def buffered_bytes(self) -> int:
        return len(self._pending)

    def send(self, payload: Any) -> None:
        """Frame ``payload`` and send what the socket takes now; ``ConnectionError`` when the
        frontend is gone (checked before anything is written: a frontend never writes back, so
        a readable socket is one its peer closed) or has stopped reading."""
        self._check_open()
        self._pending += frame(payload)
        self.flush()

    def flush(self) -> None:
        while self._pending:
            try:
                sent = self._sock.send(self._pending)
            except BlockingIOError:
                break
            del self._pending[:sent]
        if len(self._pending) > self.max_buffered_bytes:
            raise StreamBackedUp(f"{len(self._pending)} bytes wait for the frontend to read them")

    def _check_open(self) -> None:
        try:
            if self._sock.recv(1, socket.MSG_PEEK) == b"":
                raise ConnectionResetError("the frontend closed its stream socket")
        except BlockingIOError:
            return  # nothing to read: open
        raise ConnectionResetError("the frontend wrote on its stream socket")

    def close(self) -> None:
        self._sock.close()
