"""One process's metrics endpoint: ``/metrics`` in Prometheus' text format and, on the frontend,
``/sd``, the HTTP service-discovery document of the whole deployment. A thread of its own serves
it (an asyncio loop), so a scrape never waits on the process's event loop or step loop.

What it holds up to whoever reaches its port:

- a connection costs no thread while it is idle, and is closed when no request head arrives
  within ``idle_timeout_s`` (of its opening, or of the previous answer) or the head passes
  ``MAX_HEAD_BYTES``;
- at most ``max_connections`` are open: one more closes the connection that has been idle the
  longest (a scraper's next request finds room), or is refused when none is idle;
- with a ``token`` every request needs ``Authorization: Bearer <token>`` (401 otherwise); with
  ``tls_cert_pem``/``tls_key_pem`` it speaks HTTPS only;
- without a token, on an address beyond loopback, it shows no client names and no process
  addresses: ``/sd`` answers 403 and ``/metrics`` leaves out every series with a ``client``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hmac
import json
import socket
import ssl
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.registry import Collector

from tandem.kvtransfer.bind_guard import is_loopback

MAX_HEAD_BYTES = 16 << 10


@dataclass(frozen=True)
class MetricsSecurity:
    """Bearer token and TLS of every metrics endpoint of a deployment (empty: none)."""

    token: str = field(default="", repr=False)
    tls_cert_pem: bytes = field(default=b"", repr=False)
    tls_key_pem: bytes = field(default=b"", repr=False)

    @property
    def tls(self) -> bool:
        return bool(self.tls_cert_pem)


@dataclass(frozen=True)
class MetricsLimits:
    idle_timeout_s: float = 10.0
    max_connections: int = 256


class _WithoutClients(Collector):
    """``registry``'s series without those that name a client."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Any:
        for family in self.registry.collect():
            family.samples = [s for s in family.samples if not s.labels.get("client")]
            yield family


def _ssl_context(security: MetricsSecurity) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    with tempfile.TemporaryDirectory() as folder:  # the ssl module loads a chain from files only
        cert, key = Path(folder) / "cert.pem", Path(folder) / "key.pem"
        cert.write_bytes(security.tls_cert_pem)
        key.touch(mode=0o600)
        key.write_bytes(security.tls_key_pem)
        context.load_cert_chain(cert, key)
    return context


class MetricsServer:
    """Serves ``registry`` on ``host:port`` (0: a free port) until :meth:`close`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int = 0,
        discovery: Callable[[], list[dict[str, Any]]] | None = None,
        advertise: str | None = None,
        security: MetricsSecurity | None = None,
        limits: MetricsLimits | None = None,
    ) -> None:
        """``advertise``: the host others reach it at, when ``host`` is every interface."""
        self.registry, self.discovery = registry, discovery
        self.security, self.limits = security or MetricsSecurity(), limits or MetricsLimits()
        self._open = not self.security.token and not is_loopback(host)
        self._shown: CollectorRegistry = registry
        if self._open:
            self._shown = CollectorRegistry(auto_describe=False)
            self._shown.register(_WithoutClients(registry))
        self._idle_since: dict[asyncio.StreamWriter, float] = {}  # idle connections, oldest first
        self._writers: set[asyncio.StreamWriter] = set()
        sock = socket.create_server(
            (host, port),
            family=socket.AF_INET6 if ":" in host else socket.AF_INET,
            backlog=1024,
            dualstack_ipv6=host == "::",
        )
        self.host = advertise or host
        self.port = int(sock.getsockname()[1])
        context = _ssl_context(self.security) if self.security.tls else None
        started: concurrent.futures.Future[None] = concurrent.futures.Future()

        def run() -> None:
            # a loop of its own on its own thread: the caller may be running one (an async actor)
            self._loop = loop = asyncio.new_event_loop()
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(
                        self._serve,
                        sock=sock,
                        ssl=context,
                        ssl_handshake_timeout=self.limits.idle_timeout_s if context else None,
                        limit=MAX_HEAD_BYTES,
                    )
                )
            except BaseException as error:
                started.set_exception(error)
                loop.close()
                return
            started.set_result(None)
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name="metrics-http", daemon=True)
        self._thread.start()
        started.result()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        async def stop() -> None:
            self._server.close()
            for writer in list(self._writers):
                writer.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await self._server.wait_closed()

        if self._loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # closed twice
            asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=10)
            self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def _admit(self, writer: asyncio.StreamWriter) -> bool:
        if len(self._writers) >= self.limits.max_connections:
            if not self._idle_since:
                return False
            oldest = next(iter(self._idle_since))
            self._forget(oldest)
            oldest.close()
        self._writers.add(writer)
        return True

    def _forget(self, writer: asyncio.StreamWriter) -> None:
        self._writers.discard(writer)
        self._idle_since.pop(writer, None)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if not self._admit(writer):
            writer.close()
            return
        try:
            while True:
                self._idle_since[writer] = time.monotonic()
                try:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self.limits.idle_timeout_s)
                except (
                    TimeoutError,
                    asyncio.IncompleteReadError,
                    asyncio.LimitOverrunError,
                    ConnectionError,
                ):
                    return
                finally:
                    self._idle_since.pop(writer, None)
                keep_alive = self._answer(head, writer)
                await writer.drain()
                if not keep_alive:
                    return
        except (ConnectionError, ssl.SSLError):
            return
        finally:
            self._forget(writer)
            writer.close()

    def _answer(self, head: bytes, writer: asyncio.StreamWriter) -> bool:
        """Write the answer to one request; whether the connection stays open."""
        lines = head.decode("latin-1").split("\r\n")
        parts = lines[0].split(" ")
        headers = {}
        for line in lines[1:]:
            name, sep, value = line.partition(":")
            if sep:
                headers[name.strip().lower()] = value.strip()
        if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
            self._reply(writer, 400, "text/plain", b"bad request line\n", keep_alive=False)
            return False
        method, target, version = parts
        keep_alive = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
        if method not in ("GET", "HEAD"):
            self._reply(writer, 405, "text/plain", b"only GET\n", keep_alive, extra={"Allow": "GET"})
            return keep_alive
        token = self.security.token
        sent = headers.get("authorization", "").encode("latin-1")
        if token and not hmac.compare_digest(sent, f"Bearer {token}".encode()):
            extra = {"WWW-Authenticate": 'Bearer realm="tandem-metrics"'}
            self._reply(writer, 401, "text/plain", b"a bearer token is needed\n", keep_alive, extra=extra)
            return keep_alive
        path = target.split("?", 1)[0]
        body_only = method == "GET"
        if path == "/metrics":
            body = generate_latest(self._shown)
            self._reply(writer, 200, CONTENT_TYPE_LATEST, body, keep_alive, body_only=body_only)
        elif path == "/sd" and self.discovery is not None:
            if self._open:
                why = b"the discovery document lists every process's address: set --metrics-token-file\n"
                self._reply(writer, 403, "text/plain", why, keep_alive)
            else:
                body = json.dumps(self.discovery()).encode()
                self._reply(writer, 200, "application/json", body, keep_alive, body_only=body_only)
        else:
            known = "/metrics, /sd" if self.discovery is not None else "/metrics"
            self._reply(writer, 404, "text/plain", f"no {path} here; try {known}\n".encode(), keep_alive)
        return keep_alive

    @staticmethod
    def _reply(
        writer: asyncio.StreamWriter,
        code: int,
        content_type: str,
        body: bytes,
        keep_alive: bool,
        extra: dict[str, str] | None = None,
        body_only: bool = True,
    ) -> None:
        reason = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 403: "Forbidden", 404: "Not Found"}
        head = [
            f"HTTP/1.1 {code} {reason.get(code, 'Method Not Allowed')}",
            f"Content-Type: {content_type}",
            f"Content-Length: {len(body)}",
            f"Connection: {'keep-alive' if keep_alive else 'close'}",
            *(f"{k}: {v}" for k, v in (extra or {}).items()),
        ]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode("latin-1") + (body if body_only else b""))
