"""``tandem bench autoscale``, short: the real policy on a simulated cluster over a trace of the
Mooncake format (made here, with the conversation trace's shape: a flat arrival rate, prompts of
1k to 30k tokens, a few hundred output tokens) re-timed to a 4x swing, against the static sizes
within the budget."""

from __future__ import annotations

import json
import math
import random
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.bench.autoscale_sim import SimModel, Simulation, bench_config, retime, run_autoscale_bench
from tandem.bench.router_bench import TraceRequest, read_trace
from tandem.cli.main import main


def _write_trace(path: Path, count: int, rate_per_s: float = 3.4, seed: int = 0) -> Path:
    rng = random.Random(seed)
    lines = []
    for i in range(count):
        prompt = rng.randrange(1_000, 30_000)
        blocks = list(range(i * 64, i * 64 + math.ceil(prompt / 512)))
        record = {"timestamp": int(1000 * i / rate_per_s), "input_length": prompt,
                  "output_length": rng.randrange(10, 800), "hash_ids": blocks}  # fmt: skip
        lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def trace(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _write_trace(tmp_path_factory.mktemp("trace") / "trace.jsonl", 1500)


@pytest.fixture(scope="module")
def requests(trace: Path) -> list[TraceRequest]:
    return read_trace(trace)


def test_retime_swings_the_rate_by_the_factor_asked(requests: list[TraceRequest]) -> None:
    arrivals = retime(requests, swing=4.0, cycles=1.0)
    assert arrivals == sorted(arrivals) and len(arrivals) == len(requests)
    span = arrivals[-1]
    bins = [0] * 10
    for t in arrivals:
        bins[min(int(10 * t / span), 9)] += 1
    assert max(bins) / min(bins) >= 3.0  # tenths of the span: close to the 4x of the peak/trough
    assert bins[0] < bins[5] > bins[9]  # one cycle: trough, peak, trough


def test_the_autoscaler_tracks_a_swinging_load(requests: list[TraceRequest]) -> None:
    config = replace(bench_config(rank_budget=40), downscale_ticks=6, settle_ticks=2)  # a short replay
    result = run_autoscale_bench(requests, config, swing=4.0, time_scale=1.0)
    scaled = result["autoscaler"]
    assert 0 <= scaled["slo_attainment"] <= 1 and scaled["finished"] == len(requests)
    assert scaled["adds"] >= 1 and scaled["drains"] >= 1  # it followed the load up and down
    assert result["static"] and all(
        s["prefill_groups"] * 4 + s["decode_groups"] * 2 <= 40 for s in result["static"]
    )
    # more groups, held all the time, cost more rank-seconds
    one = next(s for s in result["static"] if (s["prefill_groups"], s["decode_groups"]) == (1, 1))
    two = next(s for s in result["static"] if (s["prefill_groups"], s["decode_groups"]) == (2, 2))
    assert two["rank_seconds"] > one["rank_seconds"] and two["slo_attainment"] >= one["slo_attainment"]


def test_a_static_cluster_holds_its_ranks_for_the_whole_run(requests: list[TraceRequest]) -> None:
    config = bench_config()
    arrivals = retime(requests[:100], swing=1.0)
    model = SimModel(dt_s=0.5)
    result = Simulation(arrivals, requests[:100], model, config, 2, 3, autoscale=False).run()
    ranks = 2 * 4 + 3 * 2
    assert result.finished == 100 and result.adds == result.drains == 0
    # ranks held for every step until the last request ended, and not one step more
    assert result.rank_seconds % (ranks * model.dt_s) == pytest.approx(0, abs=1e-6)


def test_the_command_prints_json_and_refuses_bad_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write_trace(tmp_path / "t.jsonl", 200)
    assert main(["bench", "autoscale", "--trace", str(trace), "--time-scale", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"autoscaler", "static", "cheapest_static_at_autoscaler_attainment"} <= out.keys()
    assert main(["bench", "autoscale", "--trace", str(trace), "--rate-swing", "0.5"]) == 2
    assert "--rate-swing: must be >= 1" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert main(["bench", "autoscale", "--trace", str(bad)]) == 2
    assert "field 'input_length' is missing" in capsys.readouterr().err
