"""``tandem bench autoscale``, short: the real policy, with ``serve --autoscale``'s defaults, on
the simulated cluster. A load that doubles gets more capacity within a group's start time plus
one window; an idle pool shrinks to its minimum; the router's cache affinity saves prompt work;
the replay keeps a trace's bursts while it swings the rate; and the command prints the report
and refuses bad options."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest

from tandem.bench.autoscale_report import format_report
from tandem.bench.autoscale_sim import (
    SimModel,
    Simulation,
    bench_config,
    retime,
    run_autoscale_bench,
)
from tandem.bench.hindsight import hindsight_schedule
from tandem.bench.router_bench import TraceRequest
from tandem.cli.main import main
from tandem.cluster.topology import AutoscalingSpec

MODEL = SimModel(dt_s=0.5)


def _requests(rate_per_s: list[tuple[float, float]], seed: int = 0, prompt: int = 4000) -> list[TraceRequest]:
    """Poisson arrivals at ``rate`` until each ``(until_s, rate)``; distinct 4k-token prompts
    behind a shared 1k-token system prompt, 100-token answers."""
    rng = random.Random(seed)
    out, t, i = [], 0.0, 0
    for until_s, rate in rate_per_s:
        while rate > 0 and (t := t + rng.expovariate(rate)) < until_s:
            blocks = (0, 1, *range(2 + i * 8, 2 + i * 8 + math.ceil((prompt - 1024) / 512)))
            out.append(TraceRequest(t, prompt, 100, blocks))
            i += 1
        t = until_s
    return out


def _timeline(
    requests: list[TraceRequest], prefill: int = 1, decode: int = 1
) -> tuple[Simulation, list[tuple[float, int, int]]]:
    config = bench_config(MODEL)
    arrivals = [r.arrival_s for r in requests]
    sim = Simulation(arrivals, requests, MODEL, config, prefill, decode, autoscale=True)
    sim.run()
    return sim, sim.timeline


def test_the_bench_runs_the_configuration_serve_uses() -> None:
    config, spec = bench_config(), AutoscalingSpec()
    for name in (
        "upscale_ticks",
        "downscale_ticks",
        "settle_ticks",
        "margin",
        "interval_s",
        "kv_usage_target",
    ):
        assert getattr(config, name) == getattr(spec, name), name
    assert (config.ttft_slo_s, config.itl_slo_s) == (spec.ttft_slo_s, spec.itl_slo_s)
    assert (config.prefill.ranks_per_group, config.decode.ranks_per_group) == (4, 2)


def test_a_load_that_doubles_gets_more_capacity_within_a_start_and_a_window() -> None:
    """15 prompts/s (3k new tokens each: about 1.2 prefill groups busy) for 10 minutes, then
    30/s: within the start time (60 s) plus one window (60 s) of the step, prefill serves with
    more groups than it had before it."""
    requests = _requests([(600.0, 15.0), (1200.0, 30.0)])
    sim, timeline = _timeline(requests, prefill=2)
    before = max(p for t, p, _ in timeline if 480 <= t < 600)
    after = [p for t, p, _ in timeline if 600 <= t <= 600 + MODEL.startup_s + 60.0]
    assert max(after) > before, timeline
    assert sim.done == len(requests)


def test_a_pool_idle_for_a_window_shrinks_to_its_minimum() -> None:
    """A busy five minutes, then nothing for fifteen (one late request ends the run): both
    pools are back at their minimum well before the late request."""
    requests = _requests([(300.0, 60.0), (1200.0, 0.0)])
    requests.append(TraceRequest(1200.0, 4000, 100, (0,)))
    _, timeline = _timeline(requests)
    peak = max(p for _, p, _ in timeline)
    late = [(p, d) for t, p, d in timeline if 1000 <= t < 1200]
    assert peak > 1 and late and all(sizes == (1, 1) for sizes in late), timeline[-60:]


def test_the_router_affinity_saves_the_shared_prefix_and_a_static_pair_holds_its_ranks() -> None:
    requests = _requests([(120.0, 10.0)])
    config = bench_config(MODEL)
    arrivals = [r.arrival_s for r in requests]
    result = Simulation(arrivals, requests, MODEL, config, 2, 3, autoscale=False).run()
    # every prompt after each group's first finds the 1024-token system prompt cached there
    assert result.cached_share == pytest.approx(1024 / 4000, rel=0.02)
    assert result.finished == len(requests) and result.adds == result.drains == 0
    ranks = 2 * 4 + 3 * 2
    assert result.rank_seconds % (ranks * MODEL.dt_s) == pytest.approx(0, abs=1e-6)


def test_retime_swings_the_rate_and_keeps_the_traces_own_bursts() -> None:
    steady = _requests([(1000.0, 5.0)])
    arrivals = retime(steady, swing=4.0, cycles=1.0)
    assert arrivals == sorted(arrivals) and len(arrivals) == len(steady)
    bins = [0] * 10
    for t in arrivals:
        bins[min(int(10 * t / arrivals[-1]), 9)] += 1
    assert max(bins) / min(bins) >= 3.0 and bins[0] < bins[5] > bins[9]  # trough, peak, trough
    bursty = _requests([(400.0, 1.0), (420.0, 20.0), (1000.0, 1.0)])
    warped = retime(bursty, swing=4.0, cycles=1.0)
    in_burst = [w for r, w in zip(bursty, warped, strict=True) if 400 <= r.arrival_s < 420]
    # the burst stays a burst: its requests arrive within a few seconds of warped time
    assert len(in_burst) > 300 and in_burst[-1] - in_burst[0] < 40.0


def test_the_report_compares_the_autoscaler_with_every_static_pair() -> None:
    requests = _requests([(300.0, 10.0), (600.0, 30.0), (900.0, 10.0)])
    config = bench_config(MODEL, rank_budget=20, max_groups=3)
    result = run_autoscale_bench(requests, config, MODEL, swing=1.0)
    pairs = {(s["prefill_groups"], s["decode_groups"]) for s in result["static"]}
    assert pairs == {(p, d) for p in range(1, 4) for d in range(1, 4) if 4 * p + 2 * d <= 20}
    auto = result["autoscaler"]
    at = result["cheapest_static_at_autoscaler_attainment"]
    assert at is None or at["slo_attainment"] >= auto["slo_attainment"]
    same = result["best_static_at_autoscaler_rank_seconds"]
    assert same is None or same["rank_seconds"] <= auto["rank_seconds"]
    hindsight = result["hindsight_at_autoscaler_attainment"]
    assert hindsight is not None and hindsight["slo_attainment"] >= auto["slo_attainment"]
    table = format_report([{"trace": "steps", **result}], config)
    assert "| steps |" in table and "TTFT <= 1 s" in table and "hindsight schedule" in table


def test_the_hindsight_schedule_takes_the_bigger_pair_only_where_it_meets_more() -> None:
    """Two pairs over four minutes of 10 requests: the small one meets 5, the big one 8, the
    difference all in minute 1. At 0.8 the schedule is the small pair but in minute 1; more
    than the big pair meets everywhere is out of reach."""
    met = {(1, 1): {0: 2, 2: 2, 3: 1}, (2, 1): {0: 2, 1: 3, 2: 2, 3: 1}}
    ranks = {(1, 1): 2, (2, 1): 4}
    best = hindsight_schedule(met, ranks, 0.8, 10, 60.0)
    assert best is not None
    assert (best["rank_seconds"], best["slo_attainment"], best["bins"]) == ((2 + 4 + 2 + 2) * 60.0, 0.8, 4)
    assert hindsight_schedule(met, ranks, 0.5, 10, 60.0) == {**best, "rank_seconds": 4 * 2 * 60.0,
                                                            "slo_attainment": 0.5}  # fmt: skip
    assert hindsight_schedule(met, ranks, 0.81, 10, 60.0) is None


def _write_trace(path: Path, count: int) -> Path:
    lines = [
        json.dumps(
            {"timestamp": 250 * i, "input_length": 2000, "output_length": 50, "hash_ids": [i, i + 1, i + 2]}
        )
        for i in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_the_command_prints_one_result_per_trace_and_refuses_bad_options(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = _write_trace(tmp_path / "t.jsonl", 200)
    argv = ["bench", "autoscale", "--trace", str(trace), "--rank-budget", "12", "--max-groups", "2"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["trace"] for r in out] == [str(trace)]
    assert {"autoscaler", "static", "cheapest_static_at_0.99"} <= out[0].keys()
    assert main(argv) == 0 and "| trace | autoscaler |" in capsys.readouterr().out
    assert main(["bench", "autoscale", "--trace", str(trace), "--rate-swing", "0.5"]) == 2
    assert "--rate-swing: must be >= 1" in capsys.readouterr().err
    assert main(["bench", "autoscale", "--trace", str(trace), "--rank-budget", "4"]) == 2
    assert "rank_budget" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0}\n')
    assert main(["bench", "autoscale", "--trace", str(bad)]) == 2
    assert "field 'input_length' is missing" in capsys.readouterr().err


def test_the_simulated_peak_rate_reads_a_burst_in_full_while_the_pool_computes_less() -> None:
    """Three times one group's rate for 15 s (40 prompts/s of 3k new tokens against 40k tokens/s),
    then nothing: the tokens computed a second over the window stay within one group's rate,
    while the peak rate as routed is the burst's, as ``max_over_time(rate(...[15s]))`` reads it."""
    requests = _requests([(60.0, 0.0), (75.0, 40.0), (120.0, 0.0)])
    requests.append(TraceRequest(400.0, 4000, 100, (0,)))  # the run goes on past the burst
    sim = Simulation([r.arrival_s for r in requests], requests, MODEL, bench_config(MODEL), 1, 1, False)
    new = sum(r.input_length - 1024 for r in requests[:-1]) + 1024  # the first misses the prefix
    t = 0.0
    while t < 80.0:  # the cluster's steps, without the autoscaler
        sim._arrive(t)
        sim._start_prefills(t)
        sim._admit(t)
        sim._decode(t)
        t += MODEL.dt_s
    signals = sim._prefill_signals(t)
    assert signals.demand_peak == pytest.approx(new / 15.0)
    assert signals.arrival_rate == pytest.approx(new / 60.0)  # the window's mean, as routed
    assert signals.demand is not None and 0 < signals.demand * 60.0 / 20.0 <= MODEL.prefill_tokens_per_s
