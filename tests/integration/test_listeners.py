"""What a deployment listens on. With the default host every socket that any process of
``tandem serve`` opens is on loopback: the frontend's gRPC and metrics ports, the controller's
and each rank's metrics, each rank's channel server, DEP rendezvous and collectives, NIXL (UCX),
the Mooncake store clients (whose transport binds every interface unless kept, see
``kvtransfer/bind_guard.py``), ``mooncake_master``'s RPC, metadata and metrics ports, and the
embedded Ray's GCS, raylet, agents and workers."""

from __future__ import annotations

import contextlib
import json
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path

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


def _get(url: str, token: str | None = None) -> tuple[int, bytes]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as reply:
            return int(reply.status), reply.read()
    except urllib.error.HTTPError as error:
        return error.code, error.read()


def test_serve_with_a_store_and_metrics_listens_on_loopback_alone(tmp_path: Path) -> None:
    """...and every metrics endpoint (the frontend's, the controller's, each rank's) asks for the
    deployment's metrics token."""
    metrics_port = _free_port()
    (tmp_path / "metrics-token").write_text("m3trics\n")
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
            "--metrics-token-file",
            str(tmp_path / "metrics-token"),
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
        base = f"http://127.0.0.1:{metrics_port}"
        assert _get(f"{base}/metrics")[0] == 401 and _get(f"{base}/sd")[0] == 401
        code, body = _get(f"{base}/metrics", "m3trics")
        assert code == 200 and b"tandem_" in body
        code, body = _get(f"{base}/sd", "m3trics")
        targets = [t for group in json.loads(body) for t in group["targets"]]
        assert code == 200 and len(targets) == 6  # the frontend, the controller, 4 ranks
        for target in targets:
            assert _get(f"http://{target}/metrics")[0] == 401
            assert _get(f"http://{target}/metrics", "m3trics")[0] == 200

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
