"""``tandem bench metrics``, short: batches alternate metrics on and off on one served cluster."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import ray

from tandem.bench.metrics_bench import run_metrics_bench


@pytest.fixture
def ray_stopped() -> Iterator[None]:
    yield
    ray.shutdown()


def test_the_metrics_benchmark_compares_on_and_off_on_one_cluster(tiny_dir: Path, ray_stopped: None) -> None:
    """Every batch serves all its tokens; an "off" batch is never scraped."""
    result = run_metrics_bench(tiny_dir, requests=2, prompt_tokens=8, output_tokens=4, rounds=2)
    sides = [b["metrics"] for b in result["batches"]]
    assert sides == ["on", "off", "off", "on"]
    assert all(b["output_tokens"] == 8 and b["tokens_per_s"] > 0 for b in result["batches"])
    assert all(b["scrapes"] == 0 for b in result["batches"] if b["metrics"] == "off")
    assert result["ratio_on_off"] > 0
