"""A Prometheus server of our own: the ``prometheus`` binary on PATH (Debian's package), run
with a given configuration on a free loopback port, its data in a temporary folder removed when
it stops. ``tandem serve --autoscale`` runs one when given no ``--prometheus-url``."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path


class PrometheusNotFound(RuntimeError):
    def __init__(self) -> None:
        super().__init__(
            "no prometheus binary on PATH: install it (apt-get install prometheus) or pass --prometheus-url"
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PrometheusProcess:
    def __init__(self, config_yaml: str, start_timeout_s: float = 60.0) -> None:
        binary = shutil.which("prometheus")
        if binary is None:
            raise PrometheusNotFound()
        self.folder = Path(tempfile.mkdtemp(prefix="tandem-prometheus-"))
        (self.folder / "prometheus.yml").write_text(config_yaml)
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}"
        self._log = (self.folder / "log").open("w")
        self._process = subprocess.Popen(
            [
                binary,
                f"--config.file={self.folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={self.folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=subprocess.DEVNULL,
            stderr=self._log,
        )
        try:
            self._wait_ready(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except OSError:
                pass
            if self._process.poll() is not None or time.monotonic() > deadline:
                log = (self.folder / "log").read_text()[-2000:]
                raise RuntimeError(f"prometheus did not start: {log}")
            time.sleep(0.2)

    def wait_for_targets(self, count: int, timeout_s: float = 60.0) -> None:
        """Until ``count`` targets are up (Prometheus hands discovered targets to its scrapers
        every 5 s, so the first scrapes come a few seconds after the start)."""
        deadline = time.monotonic() + timeout_s
        while True:
            with urllib.request.urlopen(f"{self.url}/api/v1/targets?state=active", timeout=5) as reply:
                targets = json.load(reply)["data"]["activeTargets"]
            if sum(t["health"] == "up" for t in targets) >= count:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"prometheus at {self.url}: {len(targets)} targets, not {count} up")
            time.sleep(0.25)

    def stop(self) -> None:
        self._process.terminate()
        try:
            self._process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
        self._log.close()
        shutil.rmtree(self.folder, ignore_errors=True)
