"""``tandem bench serve`` against a real deployment on loopback (Ray, NIXL, gRPC): one DEP1
prefill and one DEP1 decode group of the tiny model, pages of 16 tokens; a concurrency sweep with
a shared prefix, and a ten-request trace slice with its Markdown table and figures."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.cli.main import main
from tandem.cluster.ray_bootstrap import shutdown_ray
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import PoolSpec, Topology
from tandem.model.make_tiny import make_tiny_checkpoint

PAGE = 16


@pytest.fixture(scope="module")
def addr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tiny = make_tiny_checkpoint(tmp_path_factory.mktemp("bench-serve") / "tiny", seed=0)
    pool = PoolSpec(dep=1, page_size=PAGE, num_pages=256)
    topology = Topology.preset("local").model_copy(update={"prefill": pool, "decode": pool})
    server = Server(ServeOptions(topology, tiny, port=0, dtype="float32"))
    server.start()
    try:
        yield f"127.0.0.1:{server.port}"
    finally:
        server.stop()
        shutdown_ray()


def test_a_sweep_reports_each_point_from_the_bills(addr: str, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        ["bench", "serve", "--addr", addr, "--concurrency", "1,2", "--requests-per-point", "4",
         "--prompt-tokens", "48", "--shared-prefix-tokens", "32", "--prefixes", "1", "--output-tokens", "4",
         "--json"]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    result = json.loads(out)
    assert result["deployment"]["prefill_ranks"] == 1 and result["deployment"]["decode_ranks"] == 1
    points = result["points"]
    assert [p["concurrency"] for p in points] == [1, 2]
    for p in points:
        assert (p["completed"], p["failed"]) == (4, 0), p["errors"]
        assert p["output_tokens"] == 16  # ignore_eos and max_tokens: every output as long as asked
        assert p["output_tokens_per_s"] == pytest.approx(p["output_tokens"] / p["wall_s"], rel=1e-9)
        assert p["request_throughput"] == pytest.approx(4 / p["wall_s"], rel=1e-9)
        for name in ("ttft_ms", "itl_ms", "tpot_ms", "e2e_ms"):
            assert set(p[name]) == {"p50", "p90", "p99"} and p[name]["p50"] > 0
        assert p["e2e_ms"]["p50"] >= p["ttft_ms"]["p50"]
        assert p["goodput_rps"] <= p["request_throughput"]
        assert set(p["input_tokens_per_s"]) == {"cached", "new"}
        assert p["composition_ms"]["prefill_compute"] > 0 and p["composition_ms"]["decode"] > 0
        assert p["prompt_tokens"] == 4 * 48
    # the prefix is in the prefill rank's cache after the first request: two pages of 16 a request
    assert points[0]["input_tokens_per_s"]["cached"] > 0 and points[1]["cached_tokens"] == 4 * 32
    assert 0 < points[1]["cache_hit_share"] <= 32 / 48
    assert points[1]["predicted_cached_tokens"] == points[1]["cached_tokens"]


def test_a_trace_slice_prints_markdown_and_writes_three_figures(
    addr: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # twelve requests of two conversations, each turn repeating its conversation's blocks
    lines = []
    for i in range(12):
        conversation, turn = i % 2, i // 2
        ids = [0] + [100 * (conversation + 1) + b for b in range(turn + 1)]
        lines.append(json.dumps({"timestamp": i * 50, "input_length": 512 * len(ids) - 200,
                                 "output_length": 40, "hash_ids": ids}))  # fmt: skip
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    plots = tmp_path / "plots"
    rc = main(
        ["bench", "serve", "--addr", addr, "--trace", str(trace), "--start", "1", "--max-requests", "10",
         "--block-tokens", "16", "--time-scale", "0.5", "--max-output-tokens", "3", "--markdown",
         "--plot", str(plots)]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert "trace replay: 10 requests, 0 clipped to the context" in out
    header = next(line for line in out.splitlines() if line.startswith("| point | done | failed |"))
    row = next(line for line in out.splitlines() if line.startswith("| trace |"))
    assert header and [c.strip() for c in row.split("|")[2:4]] == ["10", "0"]
    assert "| trace | " in out and "|---|" in out and "**mean composition from the bills, ms**" in out
    figures = sorted(plots.glob("*.png"))
    assert [f.name for f in figures] == ["pareto.png", "throughput_split.png", "ttft_composition.png"]
    assert all(f.stat().st_size > 1000 for f in figures)
