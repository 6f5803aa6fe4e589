"""``tandem plan memory``: the table, the JSON, and one-line errors with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.cli.main import main

DEEPSEEK_V3 = Path(__file__).resolve().parents[2] / "deploy" / "models" / "deepseek-v3"
PLAN = ["plan", "memory", "--gpu-memory-gib", "141", "--dtype", "bfloat16"]
V3 = ["--model", str(DEEPSEEK_V3)]


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_json_has_every_rank_and_says_whether_it_fits(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(
        [*PLAN, "--model", str(DEEPSEEK_V3), "--preset", "9xdep2-1xdep16", "--json"], capsys
    )
    assert code == 0, err  # a plan that does not fit is still a plan
    plan = json.loads(out)
    assert plan["fits"] is False
    ranks = plan["ranks"]
    assert len(ranks) == 9 * 2 + 16
    keys = {"role", "group", "rank", "weight_bytes", "workspace_bytes", "kv_page_bytes", "kv_pages", "fits"}
    assert keys <= set(ranks[0])
    assert (
        ranks[0]["group"] == "prefill0"
        and ranks[17]["group"] == "prefill8"
        and ranks[18]["group"] == "decode0"
    )
    assert {(r["role"], r["fits"]) for r in ranks} == {("prefill", False), ("decode", True)}
    assert all(r["kv_pages"] == 0 for r in ranks if r["role"] == "prefill")


def test_table_folds_ranks_with_the_same_numbers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(
        [*PLAN, "--model", str(DEEPSEEK_V3 / "config.json"), "--preset", "9xdep2-1xdep16"], capsys
    )
    assert code == 0
    rows = [line.split() for line in out.splitlines() if line.startswith(("prefill ", "decode "))]
    assert [row[:3] for row in rows] == [["prefill", "prefill0-8", "0-1"], ["decode", "decode0", "0-15"]]
    assert [row[-1] for row in rows] == ["no", "yes"]
    assert out.splitlines()[-1].startswith("fits: no; rank prefill0/0 (prefill) cannot hold the model")


def test_topology_file_gives_the_gpu_memory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("gpu_memory_gib: 141\nprefill: {dep: 16}\ndecode: {dep: 8}\n")
    code, out, _ = _run(
        ["plan", "memory", "--model", str(DEEPSEEK_V3), "--topology", str(path), "--json"], capsys
    )
    plan = json.loads(out)
    # no --dtype: serve's default, auto, which a plan of GPU memory reads as a GPU's bfloat16
    assert code == 0 and plan["fits"] is True and plan["dtype"] == "bfloat16"
    assert plan["gpu_memory_bytes"] == 141 << 30 and plan["utilization"] == 0.9


@pytest.mark.parametrize(
    "args,expected",
    [
        (["--model", "/nonexistent/model", "--preset", "local", "--gpu-memory-gib", "80"],
         "/nonexistent/model: no such model directory"),
        (["--model", "{json}", "--preset", "local", "--gpu-memory-gib", "80"],
         "bad.json: cannot read it as JSON"),
        ([*V3, "--preset", "nope", "--gpu-memory-gib", "80"], "--preset: no preset 'nope'"),
        ([*V3, "--preset", "local"], "--gpu-memory-gib: local sets no gpu_memory_gib"),
        ([*V3, "--preset", "local", "--gpu-memory-gib", "80", "--utilization", "2"],
         "--utilization: must be in (0, 1]"),
    ],
)  # fmt: skip
def test_bad_input_exits_2_naming_the_file_or_flag(
    args: list[str], expected: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    code, out, err = _run(["plan", "memory", *(str(bad) if a == "{json}" else a for a in args)], capsys)
    assert code == 2 and out == ""
    assert err.startswith("tandem: error: ") and expected in err and err.count("\n") == 1
