"""One process's metrics endpoint: ``/metrics`` in Prometheus' text format and, on the frontend,
``/sd``, the HTTP service-discovery document of the whole deployment. A thread of its own serves
it, so a scrape never waits on the process's event loop or step loop."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


class MetricsServer:
    """Serves ``registry`` on ``host:port`` (0: a free port) until :meth:`close`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int = 0,
        discovery: Callable[[], list[dict[str, Any]]] | None = None,
        advertise: str | None = None,
    ) -> None:
        """``advertise``: the host others reach it at, when ``host`` is every interface."""
        server_registry, sd = registry, discovery

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, CONTENT_TYPE_LATEST, generate_latest(server_registry))
                elif path == "/sd" and sd is not None:
                    self._reply(200, "application/json", json.dumps(sd()).encode())
                else:
                    known = "/metrics, /sd" if sd is not None else "/metrics"
                    self._reply(404, "text/plain", f"no {path} here; try {known}\n".encode())

            def _reply(self, code: int, content_type: str, body: bytes) -> None:
                self.send_response(code)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                pass  # one line per scrape would drown the process's log

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.host = advertise or host
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="metrics-http", daemon=True)
        self._thread.start()

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
