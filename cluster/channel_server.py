"""A rank's end of its frontends' channels (``wire/channel.py``; ``frontend/rank_channel.py`` is
the other end).

A submit as a Ray actor call costs the frontend 0.6 to 0.9 ms of CPU (the call's dispatch, its
reply and Ray's threads) against a few tens of microseconds for a frame on a socket, and a step's
stream batch as an actor call costs the rank a few hundred microseconds of Python; over a
channel each is one frame.

Each connection has a thread that reads its frames in order: ``on_submit`` runs on it (the items
are checked there and handed to the loop) and its answer is written before the next frame is
read; ``on_abort`` likewise. The rank's loop thread sends each frontend its stream batch with
:meth:`ChannelServer.send_to`, which never blocks: a frame the kernel does not take at once
waits in the connection's buffer and goes out at the next :meth:`flush` (each loop iteration),
and a frontend that leaves ``MAX_BUFFERED_BYTES`` unread is counted gone. A frontend that opens
a new channel (it reconnected, or restarted under its name) replaces its old one.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
import secrets
import select
import socket
import threading
from collections.abc import Callable
from typing import Any, BinaryIO

from tandem.engine.rank_loop import RankDraining
from tandem.wire.channel import (
    HELLO_TIMEOUT_S,
    MAX_BUFFERED_BYTES,
    SECRET_BYTES,
    Abort,
    Answer,
    Endpoint,
    Hello,
    Refusal,
    Submit,
    Subscribe,
)
from tandem.wire.framing import LENGTH_BYTES, MAX_FRAME_BYTES, frame, unframe

log = logging.getLogger(__name__)


_END, _BAD = object(), object()  # what ``_frame`` reads at the end of a connection, or a bad frame


class StreamBackedUp(ConnectionError):
    """The frontend has not taken the bytes already sent to it."""


class ServerConnection:
    """One frontend's channel, as the rank holds it. :meth:`send` may be called from the loop
    thread and the connection's reader thread at once."""

    def __init__(self, sock: socket.socket, frontend: str, max_buffered_bytes: int) -> None:
        self.frontend = frontend
        self.max_buffered_bytes = max_buffered_bytes
        self._sock = sock
        self._lock = threading.Lock()
        self._pending = bytearray()
        self._queued = self._written = 0  # bytes ever queued, and of those written to the socket
        self._closed = False

    @property
    def is_open(self) -> bool:
        return not self._closed

    @property
    def buffered_bytes(self) -> int:
        return len(self._pending)

    def send(self, message: Any) -> None:
        self.post(frame(message))

    def post(self, data: bytes) -> int:
        """Queue ``data`` and write what the socket takes now; the count of bytes queued once
        it is in (see :meth:`wait_written`)."""
        with self._lock:
            if self._closed:
                raise ConnectionResetError(f"the channel of frontend {self.frontend} is closed")
            self._pending += data
            self._queued += len(data)
            mark = self._queued
            self._write_locked()
        return mark

    def flush(self) -> None:
        """Write what waits; ``ConnectionError`` when the frontend is gone or has stopped reading."""
        with self._lock:
            if self._closed:
                raise ConnectionResetError(f"the channel of frontend {self.frontend} is closed")
            self._write_locked()

    def wait_written(self, mark: int) -> None:
        """Block (a reader thread, never the loop) until the first ``mark`` bytes are written."""
        while True:
            with self._lock:
                if self._written >= mark:
                    return
                if self._closed:
                    raise ConnectionResetError(f"the channel of frontend {self.frontend} is closed")
                self._write_locked()
                if self._written >= mark:
                    return
            select.select([], [self._sock], [], 0.1)

    def _write_locked(self) -> None:
        while self._pending:
            try:
                sent = self._sock.send(self._pending, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            except OSError as exc:
                self._close_locked()
                raise ConnectionResetError(f"the channel of frontend {self.frontend} failed: {exc}") from exc
            del self._pending[:sent]
            self._written += sent
        if len(self._pending) > self.max_buffered_bytes:
            self._close_locked()
            raise StreamBackedUp(f"{len(self._pending)} bytes wait for frontend {self.frontend} to read them")

    def close(self) -> None:
        with self._lock:
            self._close_locked()

    def _close_locked(self) -> None:
        if not self._closed:
            self._closed = True
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)


class ChannelServer:
    """Listens on ``host`` (a port the OS picks) until :meth:`close`. ``on_submit``, ``on_abort``
    and ``on_subscribe`` are called on a connection's thread; ``on_submit`` raises to refuse,
    ``on_subscribe(frontend)`` returns the snapshot of the KV events it subscribes the frontend
    to (or raises to refuse)."""

    def __init__(
        self,
        host: str,
        on_submit: Callable[[list[Any]], None],
        on_abort: Callable[[list[str]], None],
        on_subscribe: Callable[[str], Any] | None = None,
        max_frame_bytes: int = MAX_FRAME_BYTES,
        max_buffered_bytes: int = MAX_BUFFERED_BYTES,
    ) -> None:
        self._on_submit, self._on_abort, self._on_subscribe = on_submit, on_abort, on_subscribe
        self.max_frame_bytes, self.max_buffered_bytes = max_frame_bytes, max_buffered_bytes
        self.secret = secrets.token_bytes(SECRET_BYTES)
        self._sock = socket.create_server((host, 0))
        self.address: tuple[str, int] = (host, self._sock.getsockname()[1])
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._by_frontend: dict[str, ServerConnection] = {}
        self._closed = False
        self.refused = 0  # connections closed for a wrong secret or hello, or a bad frame
        self.submits = 0  # submits answered
        threading.Thread(target=self._accept, name="channel-server", daemon=True).start()

    def endpoint(self) -> Endpoint:
        """What a frontend needs to open a channel: host, port and the secret."""
        return Endpoint(*self.address, self.secret)

    def connection(self, frontend: str) -> ServerConnection | None:
        """The frontend's open channel, if it has one."""
        connection = self._by_frontend.get(frontend)
        return connection if connection is not None and connection.is_open else None

    def send_to(self, frontend: str, message: Any) -> bool:
        """Send ``message`` to a frontend without blocking; False when it has no open channel
        (it is gone: what the rank holds for it must end)."""
        connection = self.connection(frontend)
        if connection is None:
            return False
        try:
            connection.send(message)
        except ConnectionError as exc:
            log.warning("the channel of frontend %s failed: %s", frontend, exc)
            return False
        return True

    def flush(self) -> list[str]:
        """Write what the channels did not take at once (every loop iteration); the frontends
        whose channel failed (what it held for them is lost: their requests must end)."""
        failed = []
        for frontend, connection in list(self._by_frontend.items()):
            if not connection.buffered_bytes:
                continue
            try:
                connection.flush()
            except ConnectionError as exc:
                log.warning("the channel of frontend %s failed: %s", frontend, exc)
                failed.append(frontend)
        return failed

    def close(self) -> None:
        """Stop listening and close every channel (their threads end)."""
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, set()
            connections, self._by_frontend = list(self._by_frontend.values()), {}
        for connection in connections:
            connection.close()
        for sock in (self._sock, *sockets):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), name="channel", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with self._lock:
            if self._closed:
                conn.close()
                return
            self._sockets.add(conn)
        connection: ServerConnection | None = None
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HELLO_TIMEOUT_S)
            with conn.makefile("rb") as reader:
                hello = self._hello(reader)
                if hello is None:
                    self.refused += 1
                    return
                conn.settimeout(None)  # reads block this thread; writes never block (MSG_DONTWAIT)
                connection = ServerConnection(conn, hello.frontend, self.max_buffered_bytes)
                with self._lock:
                    old = self._by_frontend.get(hello.frontend)
                    self._by_frontend[hello.frontend] = connection
                if old is not None:
                    old.close()
                self._read_frames(reader, connection)
        except OSError:
            pass  # the frontend went away: it fails what it was waiting on
        finally:
            with self._lock:
                self._sockets.discard(conn)
                if connection is not None and self._by_frontend.get(connection.frontend) is connection:
                    del self._by_frontend[connection.frontend]
            if connection is not None:
                connection.close()
            conn.close()

    def _hello(self, reader: BinaryIO) -> Hello | None:
        """The connection's hello; None (it is closed) for a wrong secret, hello or frame."""
        secret = reader.read(SECRET_BYTES)
        if len(secret) < SECRET_BYTES or not hmac.compare_digest(secret, self.secret):
            return None
        hello = self._frame(reader)
        return hello if isinstance(hello, Hello) and isinstance(hello.frontend, str) else None

    def _frame(self, reader: BinaryIO) -> Any:
        """The next frame's message; ``_End`` at the end of the connection, ``_Bad`` for a frame
        too large or that is no message."""
        head = reader.read(LENGTH_BYTES)
        if len(head) < LENGTH_BYTES:
            return _END  # closed between frames
        length = int.from_bytes(head, "big")
        if length > self.max_frame_bytes:
            log.warning("channel server: a frame of %d bytes, closing the connection", length)
            return _BAD
        body = reader.read(length)
        if len(body) < length:
            return _END  # closed inside a frame
        try:
            return unframe(body)
        except Exception as exc:
            log.warning("channel server: a frame that is no message (%s), closing the connection", exc)
            return _BAD

    def _read_frames(self, reader: BinaryIO, connection: ServerConnection) -> None:
        while True:
            message = self._frame(reader)
            if isinstance(message, Submit) and isinstance(message.seq, int):
                mark = connection.post(frame(Answer(message.seq, self._run(list(message.requests)))))
                self.submits += 1
                connection.wait_written(mark)
            elif isinstance(message, Subscribe) and isinstance(message.seq, int):
                refused = self._subscribe(connection)
                connection.wait_written(connection.post(frame(Answer(message.seq, refused))))
            elif isinstance(message, Abort):
                try:
                    self._on_abort(list(message.request_ids))
                except Exception:  # a rank not set up holds nothing to abort
                    log.exception("channel server: an abort failed")
            elif message is _END:
                return
            else:
                self.refused += 1
                if message is not _BAD:
                    log.warning("channel server: a %s frame, closing the connection", type(message).__name__)
                return

    def _subscribe(self, connection: ServerConnection) -> Refusal | None:
        """The snapshot on the channel (before the answer, so before any later batch is used)."""
        if self._on_subscribe is None:
            return False, "this rank publishes no KV events"
        try:
            snapshot = self._on_subscribe(connection.frontend)
        except Exception as exc:
            return False, f"{type(exc).__name__}: {exc}"
        connection.send(snapshot)
        return None

    def _run(self, items: list[Any]) -> Refusal | None:
        try:
            self._on_submit(items)
        except RankDraining as exc:
            return True, str(exc)
        except Exception as exc:  # the items' own fault, or a rank that cannot take work: this submit's
            return False, f"{type(exc).__name__}: {exc}"
        return None
