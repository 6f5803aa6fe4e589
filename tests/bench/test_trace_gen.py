from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.bench.router_bench import read_trace, run_router_bench, shared_cache_hit_rate
from tandem.bench.trace_gen import (
    BurstyShortShape,
    LongPromptShape,
    bursty_short_trace,
    long_prompt_trace,
    write_trace,
)
from tandem.cli.main import main

# A few minutes of the long-prompt shape, on fewer and shorter documents: a second to replay.
SMALL = LongPromptShape(
    seed=1,
    duration_s=240.0,
    sessions_per_s=0.4,
    documents=40,
    document_tokens_median=3_000,
    think_s_mean=30.0,
)


def small_trace(path: Path) -> Path:
    write_trace(path, long_prompt_trace(SMALL))
    return path


def test_the_trace_is_seeded_in_mooncakes_format_with_chained_block_ids(tmp_path: Path) -> None:
    records = long_prompt_trace(SMALL)
    assert records == long_prompt_trace(SMALL) and records != long_prompt_trace(LongPromptShape(seed=2))
    stats = write_trace(tmp_path / "t.jsonl", records)
    trace = read_trace(tmp_path / "t.jsonl")  # the router bench's own checks of every field
    assert len(trace) == stats["requests"] == len(records) > 50
    assert all(r.arrival_s <= SMALL.duration_s for r in trace)
    assert [r.arrival_s for r in trace] == sorted(r.arrival_s for r in trace)
    # the system prompt (1,200 tokens: 2 full blocks) starts every prompt
    assert {r.hash_ids[:2] for r in trace} == {trace[0].hash_ids[:2]}
    # chained: equal ids at block i mean equal ids at every block before it
    first_seen: dict[int, tuple[int, ...]] = {}
    for r in trace:
        for i, block in enumerate(r.hash_ids):
            assert first_seen.setdefault(block, r.hash_ids[:i]) == r.hash_ids[:i]
    # long shared prefixes: a cache shared by everyone would find most of the blocks
    assert shared_cache_hit_rate(trace, None) > 0.5


def test_the_default_shape_has_long_prompts() -> None:
    records = long_prompt_trace(LongPromptShape(duration_s=120.0))
    mean = sum(r["input_length"] for r in records) / len(records)
    assert 10_000 < mean < 20_000
    with pytest.raises(ValueError, match="sessions_per_s"):
        LongPromptShape(sessions_per_s=0.0)


def test_a_host_tier_and_a_store_each_find_at_least_as_much_and_the_tiers_add_up(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    report = run_router_bench(
        trace,
        prefill_ranks=3,
        capacity_blocks=40,
        host_capacity_blocks=160,
        store=True,
        store_capacity_blocks=2_000,
    )
    tiers = report["tiers"]
    assert list(tiers) == ["device", "device+host", "device+host+store"]
    device, host, store = (tiers[name] for name in tiers)
    assert device["hit_rate"] < host["hit_rate"] <= store["hit_rate"] <= report["hit_rate"]["oracle"] + 1e-9
    assert device["hits_by_tier"]["host"] == device["hits_by_tier"]["store"] == 0.0
    assert host["hits_by_tier"]["host"] > 0 and host["hits_by_tier"]["store"] == 0.0
    assert store["hits_by_tier"]["store"] > 0
    for summary in (*tiers.values(), report["round_robin"]):
        assert sum(summary["hits_by_tier"].values()) == pytest.approx(summary["hit_rate"])
    assert report["router"] == store and report["hit_rate"]["router"] == store["hit_rate"]
    assert report["hit_rate"]["router_over_oracle"] == pytest.approx(
        store["hit_rate"] / report["hit_rate"]["oracle"]
    )


def test_a_tier_slower_than_compute_is_computed_again(tmp_path: Path) -> None:
    trace = small_trace(tmp_path / "t.jsonl")
    slow = run_router_bench(
        trace, prefill_ranks=3, capacity_blocks=40, host_capacity_blocks=160, host_load_tokens_per_s=3_000.0
    )
    with_host = slow["tiers"]["device+host"]
    assert with_host["hits_by_tier"]["host"] == 0.0 and with_host["recomputed_rate"] > 0
    assert with_host["hit_rate"] == pytest.approx(with_host["hits_by_tier"]["device"])


def test_cli_writes_a_trace_and_bench_router_compares_tiers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "long.jsonl"
    assert main(["bench", "trace", "--shape", "long-prompt", "--out", str(out), "--duration-s", "60"]) == 0
    written = json.loads(capsys.readouterr().out)
    assert written["requests"] == len(out.read_text().splitlines()) > 0
    trace = small_trace(tmp_path / "small.jsonl")
    args = ["bench", "router", "--trace", str(trace), "--prefill-ranks", "3", "--capacity-blocks", "40"]
    assert main([*args, "--host-capacity-blocks", "160", "--store", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert set(report["tiers"]) == {"device", "device+host", "device+host+store"}
    assert "router_over_oracle" in report["hit_rate"] and report["parameters"]["store"] is True
    assert main([*args, "--store"]) == 0
    table = capsys.readouterr().out
    assert "device+store" in table and "round_robin" in table
    assert main([*args, "--store-capacity-blocks", "9"]) == 2
    assert "--store-capacity-blocks needs --store" in capsys.readouterr().err


def test_the_bursty_shape_has_short_prompts_behind_shared_system_prompts_and_real_bursts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shape = BurstyShortShape(seed=3, duration_s=600.0)
    records = bursty_short_trace(shape)
    assert records == bursty_short_trace(shape) and records != bursty_short_trace(BurstyShortShape(seed=4))
    write_trace(tmp_path / "b.jsonl", records)
    trace = read_trace(tmp_path / "b.jsonl")
    assert 500 < sum(r.input_length for r in trace) / len(trace) < 5_000
    # a few system prompts: the first block of every prompt is one of at most 8
    assert len({r.hash_ids[0] for r in trace}) <= shape.system_prompts
    # bursts: the busiest 10 s hold well over the mean 10 s' arrivals
    bins = [0] * 60
    for r in trace:
        bins[min(int(r.arrival_s // 10), 59)] += 1
    assert max(bins) > 2.0 * (len(trace) / 60)
    with pytest.raises(ValueError, match="burst_factor"):
        BurstyShortShape(burst_factor=0.5)
    out = tmp_path / "cli.jsonl"
    argv = ["bench", "trace", "--shape", "bursty-short", "--out", str(out), "--duration-s", "60"]
    assert main(argv) == 0
    assert json.loads(capsys.readouterr().out)["requests"] == len(read_trace(out)) > 100
