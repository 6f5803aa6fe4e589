"""A real Prometheus server (Debian's ``prometheus`` package, run by ``PrometheusProcess``) and
the queries the tests ask it."""

from __future__ import annotations

import json
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tandem.metrics.prometheus_process import PrometheusProcess


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
    process = PrometheusProcess(config_yaml)
    try:
        yield Prometheus(process.url)
    finally:
        process.stop()
