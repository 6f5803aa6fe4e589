"""What a deployment listens on. With the default host every socket that any process of
``tandem serve`` opens is on loopback: the frontend's gRPC and metrics ports, the controller's
and each rank's metrics, each rank's channel server, DEP rendezvous and collectives, NIXL (UCX),
the Mooncake store clients (whose transport binds every interface unless kept, see
``kvtransfer/bind_guard.py``), ``mooncake_master``'s RPC, metadata and metrics ports, and the
embedded Ray's GCS, raylet, agents and workers."""

from __future__ import annotations

import contextlib
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter

from tests.listening import Listener, descendants, listeners

CLI = [sys.executable, "-m", "tandem.cli"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _kind(listener: Listener) -> str:
    for kind in ("Frontend", "Controller", "RankActor", "mooncake_master", "raylet", "gcs_server"):
        if kind in listener.process:
            return kind
    return "other"


def test_serve_with_a_store_and_metrics_listens_on_loopback_alone() -> None:
    metrics_port = _free_port()
    server = subprocess.Popen(
        [
            *CLI,
            "serve",
            "--preset",
            "local",
            "--port",
            "0",
            "--kv-store",
            "auto",
            "--metrics-port",
            str(metrics_port),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    threading.Thread(target=lambda: [lines.put(line) for line in server.stdout or []], daemon=True).start()
    try:
        deadline = time.monotonic() + 300
        seen: list[str] = []
        while not any("tandem: serving" in line for line in seen):
            assert server.poll() is None and time.monotonic() < deadline, "".join(seen)
            with contextlib.suppress(queue.Empty):
                seen.append(lines.get(timeout=1))
        bound = re.search(r"on 127\.0\.0\.1:(\d+) ", seen[-1])
        assert bound is not None, seen[-1]
        port = int(bound.group(1))
        # a request crosses every hop: the channel, NIXL, the store's writes
        out = subprocess.run(
            [*CLI, "client", "generate", "hello there", "--max-tokens", "4", "--addr", f"127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=180,
        )
        assert out.returncode == 0, out.stderr
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as scrape:
            assert b"tandem_" in scrape.read()

        found = listeners(descendants(server.pid))
        exposed = [str(x) for x in found if not x.loopback]
        assert not exposed, "listening beyond loopback:\n" + "\n".join(exposed)

        kinds = Counter(_kind(x) for x in found)
        ports = {x.port for x in found if _kind(x) == "Frontend"}
        assert {port, metrics_port} <= ports, found
        # each rank: its channel, metrics, the store client's transport and handshake server,
        # UCX's wire-up listener; the master: RPC, metadata, metrics
        assert kinds["RankActor"] >= 4 * 4 and kinds["mooncake_master"] == 3, kinds
        assert kinds["Controller"] >= 1 and kinds["gcs_server"] >= 1 and kinds["raylet"] >= 1, kinds
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=90)
        except subprocess.TimeoutExpired:
            server.kill()
            raise
