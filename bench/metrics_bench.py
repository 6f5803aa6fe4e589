"""Decode throughput with metrics on against off, side by side on one cluster.

The cluster serves with metrics; batches of the same requests (random prompts, greedy,
``ignore_eos``) then alternate between "on" (every process counts and observes, and a scraper
reads every target of the discovery document once a second, as Prometheus would) and "off"
(nothing is observed, nothing scraped), in the order on, off, off, on, ... so that drift on a
shared machine falls on both sides alike. Throughput is output tokens over a batch's wall time,
on this process's clock; the figure to read is the ratio on / off of the summed throughputs.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

from tandem.bench.random_prompts import RandomPrompts
from tandem.cluster.ray_bootstrap import init_ray
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import Topology
from tandem.wire.request_params import SamplingParams


class _Scraper:
    """Reads ``/sd``, then every target's ``/metrics``, every ``interval_s`` until stopped."""

    def __init__(self, sd_address: str, interval_s: float = 1.0) -> None:
        self.sd_address, self.interval_s = sd_address, interval_s
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            with urllib.request.urlopen(f"http://{self.sd_address}/sd", timeout=5) as reply:
                targets = [t for entry in json.load(reply) for t in entry["targets"]]
            for target in targets:
                with urllib.request.urlopen(f"http://{target}/metrics", timeout=5) as reply:
                    reply.read()
                self.scrapes += 1

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.scrapes


def _batch(
    server: Server, prompts: list[list[int]], sampling: SamplingParams, metrics: bool
) -> dict[str, Any]:
    assert server.metrics_address is not None
    server.observe(metrics)
    scraper = _Scraper(server.metrics_address) if metrics else None
    start = time.monotonic()
    summaries = server.generate(prompts, [sampling] * len(prompts))
    elapsed = time.monotonic() - start
    scrapes = scraper.stop() if scraper is not None else 0
    errors = [s.error for s in summaries if s.error]
    if errors:
        raise RuntimeError(errors[0])
    tokens = sum(len(s.token_ids) for s in summaries)
    return {"metrics": "on" if metrics else "off", "output_tokens": tokens, "seconds": round(elapsed, 3),
            "tokens_per_s": round(tokens / elapsed, 2), "scrapes": scrapes}  # fmt: skip


def run_metrics_bench(
    model_dir: Path,
    preset: str = "local",
    requests: int = 16,
    prompt_tokens: int = 64,
    output_tokens: int = 64,
    rounds: int = 2,
    address: str | None = None,
) -> dict[str, Any]:
    """``rounds`` pairs of batches, one on and one off each, in the order on, off, off, on, ..."""
    init_ray(address)
    prompts = RandomPrompts(model_dir).make(requests, prompt_tokens)
    sampling = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    server = Server(ServeOptions(Topology.preset(preset), model_dir, port=0, metrics_port=0))
    server.start()
    try:
        server.generate(prompts, [sampling] * len(prompts))  # first contacts between the actors
        batches = []
        for r in range(rounds):
            for metrics in (True, False) if r % 2 == 0 else (False, True):
                batches.append(_batch(server, prompts, sampling, metrics))
        server.observe(True)
    finally:
        server.stop()

    def total(side: str) -> float:
        rows = [b for b in batches if b["metrics"] == side]
        return sum(b["output_tokens"] for b in rows) / sum(b["seconds"] for b in rows)

    return {
        "model": str(model_dir),
        "preset": preset,
        "requests": requests,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "batches": batches,
        "tokens_per_s_on": round(total("on"), 2),
        "tokens_per_s_off": round(total("off"), 2),
        "ratio_on_off": round(total("on") / total("off"), 4),
    }
