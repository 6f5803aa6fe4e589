from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.bench.router_bench import TraceError, read_trace, run_router_bench, shared_cache_hit_rate
from tandem.cli.main import main

BLOCK = 512


def conversation_trace(path: Path, conversations: int = 4, turns: int = 6) -> Path:
    """Each conversation's turn repeats its previous turn and adds two blocks, all behind a
    shared first block (a system prompt), a turn every 10 s."""
    lines = []
    for turn in range(turns):
        for conv in range(conversations):
            ids = [0] + [1000 * (conv + 1) + i for i in range(2 * turn + 2)]
            record = {
                "timestamp": turn * 10_000 + conv * 100,
                "input_length": len(ids) * BLOCK - 100,  # the last block is partial
                "output_length": 20,
                "hash_ids": ids,
            }
            lines.append(json.dumps(record))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_router_keeps_conversations_where_their_prefix_is(tmp_path: Path) -> None:
    trace = conversation_trace(tmp_path / "trace.jsonl")
    report = run_router_bench(trace, prefill_ranks=3, capacity_blocks=64, prefill_tokens_per_s=20_000.0)
    hits = report["hit_rate"]
    # Round-robin over 3 ranks moves every conversation between ranks at every turn.
    assert hits["round_robin"] < hits["router"] <= hits["oracle"]
    # The caches are large enough: the router finds everything a shared infinite cache would.
    assert hits["router"] == pytest.approx(hits["oracle"])
    assert hits["oracle"] == pytest.approx(shared_cache_hit_rate(read_trace(trace), None))
    counters = report["router"]["counters"]
    assert counters["requests_routed"] == 24
    assert counters["branch_cache_hit"] >= 20  # every later turn follows its history
    assert report["router"]["prediction_exact_share"] == 1.0
    assert report["router"]["computed_tokens_max_over_mean"] >= 1.0


def test_oracle_follows_the_first_miss_rule(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    rows = [
        {"timestamp": 0, "input_length": 3 * BLOCK, "output_length": 1, "hash_ids": [1, 2, 3]},
        # 1 hits, 9 misses, so 3 is not counted although cached; 4 blocks in all
        {"timestamp": 1, "input_length": 4 * BLOCK, "output_length": 1, "hash_ids": [1, 9, 3, 4]},
        # all three cached but one token must be computed: 2 of 3 reusable
        {"timestamp": 2, "input_length": 3 * BLOCK, "output_length": 1, "hash_ids": [1, 2, 3]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert shared_cache_hit_rate(read_trace(path), None) == pytest.approx((0 + 1 + 2) / 10)
    # an LRU of 4 blocks evicts 2 (least recent) when the second request stores 9 and 4
    assert shared_cache_hit_rate(read_trace(path), 4) == pytest.approx((0 + 1 + 1) / 10)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json", "not JSON"),
        ('{"timestamp": 5, "output_length": 1, "hash_ids": [1]}', "field 'input_length' is missing"),
        ('{"timestamp": 5, "input_length": "9", "output_length": 1, "hash_ids": []}', "field 'input_length'"),
        ('{"timestamp": -1, "input_length": 9, "output_length": 1, "hash_ids": [1]}', "field 'timestamp'"),
        ('{"timestamp": 5, "input_length": 9, "output_length": 1, "hash_ids": [1, "x"]}', "field 'hash_ids'"),
        ('{"timestamp": 5, "input_length": 1100, "output_length": 1, "hash_ids": [1]}', "field 'hash_ids'"),
        ("[1, 2]", "JSON object"),
    ],
)
def test_a_bad_line_is_named_by_file_line_and_field(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    good = '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [7, 8]}'
    path.write_text(f"{good}\n\n{line}\n")
    with pytest.raises(TraceError, match=message) as err:
        read_trace(path)
    assert f"{path}:3:" in str(err.value)


def test_cli_prints_the_report_and_rejects_bad_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = conversation_trace(tmp_path / "trace.jsonl", conversations=2, turns=3)
    args = ["bench", "router", "--trace", str(trace), "--prefill-ranks", "2"]
    assert main([*args, "--json", "--capacity-blocks", "32", "--prefill-tokens-per-s", "9000"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["parameters"]["capacity_blocks"] == 32
    assert report["parameters"]["prefill_tokens_per_s"] == 9000.0
    assert set(report["hit_rate"]) >= {"router", "round_robin", "oracle", "router_over_oracle"}
    assert main(args) == 0
    assert "block hit rate" in capsys.readouterr().out
    assert main(["bench", "router", "--trace", str(tmp_path / "missing.jsonl")]) == 2
    assert "missing.jsonl" in capsys.readouterr().err
    assert main([*args, "--policy", "nope"]) == 2
    assert "unknown prefill policy" in capsys.readouterr().err
