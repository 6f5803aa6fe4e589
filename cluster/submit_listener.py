"""A decode rank's door for its frontends' submits (``frontend/rank_channel.py`` is the other end).

A submit as a Ray actor call costs the frontend 0.6 to 0.9 ms of CPU (the call's dispatch,
its reply and Ray's threads) against a few tens of microseconds for a pickle on a socket, and a
frontend makes one for every request. Over this listener a frontend keeps one TCP connection
per decode rank. Frames::

    frontend -> rank, once:  SECRET (16 bytes: the rank's, handed out by its actor)
    frontend -> rank, each:  LENGTH (8 bytes, big-endian) PICKLE of (seq, [RankRequest, ...])
    rank -> frontend, each:  LENGTH PICKLE of (seq, None | (draining, why))

Each connection has a thread that reads a frame, runs ``submit`` on it (the same call as the
actor's ``submit``: the items are checked on this thread and handed to the loop) and answers
before it reads the next, so a frontend's submits reach the loop in the order it sent them and
an abort the frontend sends after a submit's answer finds the request. A refusal is an answer,
never the end of the connection: ``(True, why)`` when the rank is being drained (the frontend
routes the request again), ``(False, why)`` for anything else (the request fails). A connection
that does not open with the secret, or sends a frame that is too large or not a pickle, is
closed; its frontend fails the submits it was waiting on.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import socket
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

from tandem.engine.rank_loop import RankDraining
from tandem.wire.framing import LENGTH_BYTES, MAX_FRAME_BYTES, frame, unframe

log = logging.getLogger(__name__)

SECRET_BYTES = 16
HELLO_TIMEOUT_S = 5.0

Refusal = tuple[bool, str]  # (the rank is being drained, why it refused)


class SubmitListener:
    """Listens on ``host`` (a port the OS picks) until :meth:`close`; ``submit`` is called on a
    connection's thread and raises to refuse."""

    def __init__(
        self, submit: Callable[[list[Any]], None], host: str, max_frame_bytes: int = MAX_FRAME_BYTES
    ) -> None:
        self._submit = submit
        self.max_frame_bytes = max_frame_bytes
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._sock.getsockname()[1])
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._closed = False
        self.refused = 0  # connections closed for a wrong secret or a bad frame
        self.submits = 0  # frames answered
        threading.Thread(target=self._accept, name="submit-listener", daemon=True).start()

    def endpoint(self) -> tuple[str, int, bytes]:
        """What a frontend needs to connect: host, port and the secret."""
        return (*self.address, self.secret)

    def close(self) -> None:
        """Stop listening and close every connection (their threads end)."""
        with self._lock:
            self._closed = True
            connections, self._connections = self._connections, set()
        for sock in (self._sock, *connections):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name="submit-connection", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._connections.add(conn)
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HELLO_TIMEOUT_S)
            with conn.makefile("rb") as reader:
                hello = reader.read(SECRET_BYTES)
                if len(hello) < SECRET_BYTES or not hmac.compare_digest(hello, self.secret):
                    self.refused += 1
                    return
                conn.settimeout(None)
                self._answer_frames(conn, reader)
        except OSError:
            pass  # the frontend went away: it fails what it was waiting on
        finally:
            with self._lock:
                self._connections.discard(conn)
            conn.close()

    def _answer_frames(self, conn: socket.socket, reader: BinaryIO) -> None:
        while True:
            head = reader.read(LENGTH_BYTES)
            if len(head) < LENGTH_BYTES:
                return  # closed between frames
            length = int.from_bytes(head, "big")
            if length > self.max_frame_bytes:
                self.refused += 1
                log.warning("submit listener: a frame of %d bytes, closing the connection", length)
                return
            body = reader.read(length)
            try:
                seq, items = unframe(body)
                if not isinstance(seq, int) or not isinstance(items, list):
                    raise ValueError(f"expected (seq, list of items), got ({type(seq)}, {type(items)})")
            except Exception as exc:
                self.refused += 1
                log.warning("submit listener: a frame that is not a submit (%s), closing the connection", exc)
                return
            conn.sendall(frame((seq, self._run(items))))
            self.submits += 1

    def _run(self, items: list[Any]) -> Refusal | None:
        try:
            self._submit(items)
        except RankDraining as exc:
            return True, str(exc)
        except Exception as exc:  # the items' own fault, or a rank that cannot take work: this submit's
            return False, f"{type(exc).__name__}: {exc}"
        return None
