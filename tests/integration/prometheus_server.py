"""A real Prometheus server (Debian's ``prometheus`` package) on a free loopback port, with a
configuration of the test's own, in a temporary folder removed at the end."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def api(self, path: str, **params: str) -> Any:
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        with urllib.request.urlopen(f"{self.url}/api/v1/{path}{query}", timeout=10) as reply:
            body = json.load(reply)
        assert body["status"] == "success", body
        return body["data"]

    def query(self, promql: str) -> list[dict[str, Any]]:
        """An instant query's samples: each ``{"metric": labels, "value": float}``."""
        data = self.api("query", query=promql)
        return [{"metric": r["metric"], "value": float(r["value"][1])} for r in data["result"]]

    def scalar(self, promql: str) -> float | None:
        """The one sample of ``promql`` (``None`` when there is none)."""
        samples = self.query(promql)
        assert len(samples) <= 1, f"{promql} has {len(samples)} samples"
        return samples[0]["value"] if samples else None

    def wait_for(self, promql: str, expected: float, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        value = None
        while time.monotonic() < deadline:
            value = self.scalar(promql)
            if value == expected:
                return
            time.sleep(0.25)
        raise AssertionError(f"{promql} = {value} after {timeout_s} s, expected {expected}")

    def targets(self) -> list[dict[str, Any]]:
        return list(self.api("targets", state="active")["activeTargets"])


@contextmanager
def prometheus_server(config_yaml: str) -> Iterator[Prometheus]:
    binary = shutil.which("prometheus")
    if binary is None:
        raise RuntimeError(
            "prometheus is not installed: apt-get install -y --no-install-recommends prometheus "
            "(the README's test command and .ci/run install it)"
        )
    folder = Path(tempfile.mkdtemp(prefix="tandem-prometheus-"))
    (folder / "prometheus.yml").write_text(config_yaml)
    port = _free_port()
    process = subprocess.Popen(
        [
            binary,
            f"--config.file={folder / 'prometheus.yml'}",
            f"--storage.tsdb.path={folder / 'data'}",
            f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=(folder / "log").open("w"),
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"prometheus did not start: {(folder / 'log').read_text()[-2000:]}")
            time.sleep(0.2)
        yield Prometheus(url)
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        shutil.rmtree(folder, ignore_errors=True)
