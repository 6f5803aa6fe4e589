"""``tandem bench autoscale``, short: the real policy on a simulated cluster over a slice of the
Mooncake trace re-timed to a 4x swing, against the static sizes within the budget."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.bench.autoscale_sim import SimModel, Simulation, bench_config, retime, run_autoscale_bench
from tandem.bench.router_bench import read_trace
from tandem.cli.main import main

TRACE = Path(__file__).resolve().parents[3] / "shared" / "traces" / "mooncake-conversation.jsonl"


@pytest.fixture(scope="module")
def requests() -> list:  # type: ignore[type-arg]
    if not TRACE.is_file():
        pytest.skip(f"{TRACE} is not here")
    return read_trace(TRACE)[:1500]


def test_retime_swings_the_rate_by_the_factor_asked(requests: list) -> None:  # type: ignore[type-arg]
    arrivals = retime(requests, swing=4.0, cycles=1.0)
    assert arrivals == sorted(arrivals) and len(arrivals) == len(requests)
    span = arrivals[-1]
    bins = [0] * 10
    for t in arrivals:
        bins[min(int(10 * t / span), 9)] += 1
    assert max(bins) / min(bins) >= 3.0  # tenths of the span: close to the 4x of the peak/trough
    assert bins[0] < bins[5] > bins[9]  # one cycle: trough, peak, trough


def test_the_autoscaler_tracks_a_swinging_load(requests: list) -> None:  # type: ignore[type-arg]
    config = bench_config(rank_budget=40)
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


def test_a_static_cluster_holds_its_ranks_for_the_whole_run(requests: list) -> None:  # type: ignore[type-arg]
    config = bench_config()
    arrivals = retime(requests[:100], swing=1.0)
    model = SimModel(dt_s=0.5)
    result = Simulation(arrivals, requests[:100], model, config, 2, 3, autoscale=False).run()
    ranks = 2 * 4 + 3 * 2
    assert result.finished == 100 and result.adds == result.drains == 0
    # ranks held for every step until the last request ended, and not one step more
    assert result.rank_seconds % (ranks * model.dt_s) == pytest.approx(0, abs=1e-6)


def test_the_command_prints_json_and_refuses_bad_options(
    requests: list,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],  # type: ignore[type-arg]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(TRACE.read_text().splitlines()[:200]))
    assert main(["bench", "autoscale", "--trace", str(trace), "--time-scale", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert {"autoscaler", "static", "cheapest_static_at_autoscaler_attainment"} <= out.keys()
    assert main(["bench", "autoscale", "--trace", str(trace), "--rate-swing", "0.5"]) == 2
    assert "--rate-swing: must be >= 1" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert main(["bench", "autoscale", "--trace", str(bad)]) == 2
    assert "field 'input_length' is missing" in capsys.readouterr().err
