"""``tandem bench compare`` end to end on small deployments of the same two ranks (one colocated
DEP1 pair against a DEP1 prefill + DEP1 decode), each rank pinned to a core: both serve the
whole workload, the goodput figures are those of the runs' points, and the ratio is theirs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tandem.bench.compare import check_presets, format_compare, run_compare
from tandem.bench.serve_bench import Plan
from tandem.bench.serve_workload import SyntheticWorkload
from tandem.cluster.topology import PoolSpec, Topology
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.wire.request_params import InvalidRequestError


def test_presets_are_checked_before_anything_starts() -> None:
    assert list(check_presets(["colocated", "local"])) == ["colocated", "local"]
    with pytest.raises(InvalidRequestError, match="--presets: expected one colocated preset"):
        check_presets(["local", "dep16-dep2"])
    with pytest.raises(InvalidRequestError, match="--presets: expected two or more distinct"):
        check_presets(["local", "local"])
    with pytest.raises(InvalidRequestError, match="--presets: no preset 'nope'"):
        check_presets(["colocated", "nope"])


def test_the_command_refuses_a_bad_preset_list_in_one_line() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "bench", "compare", "--presets", "local,dep16-dep2"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [
        "tandem: error: --presets: expected one colocated preset and one or more disaggregated ones "
        "(e.g. colocated,local)"
    ]


def test_both_deployments_serve_the_workload_and_the_ratio_is_their_goodputs(tmp_path: Path) -> None:
    tiny = make_tiny_checkpoint(tmp_path / "tiny", seed=0)
    pool = PoolSpec(dep=1, page_size=8, num_pages=128)
    topologies = {
        "colocated": Topology(name="colocated", colocated=pool.model_copy(update={"groups": 2})),
        "disaggregated": Topology(name="disaggregated", prefill=pool, decode=pool),
    }
    workload = SyntheticWorkload(
        prompt_tokens=48, output_tokens=4, shared_prefix_tokens=16, prefixes=2, vocab_size=256
    )
    # a TTFT SLO nothing on this machine misses, so goodput is every completed request
    plan = Plan((2,), workload, requests_per_point=6, slo_ttft_ms=600_000, slo_itl_ms=600_000)
    result = run_compare(topologies, 1, plan, tiny, warmup=1)
    assert result["colocated"] == "colocated" and result["cores_per_rank"] == 1
    for name, run in result["runs"].items():
        (point,) = run["points"]
        assert point["completed"] == point["requests"] == 6, (name, point["errors"])
        assert result["goodput_rps"][name] == pytest.approx(point["goodput_rps"])
        assert point["goodput_rps"] > 0
        assert point["goodput_rps"] == pytest.approx(point["request_throughput"])
        assert run["ranks"] == 2
    assert result["runs"]["colocated"]["topology"] == "colocated: 2xDEP1 colocated"
    goodput = result["goodput_rps"]
    assert result["ratio"] == pytest.approx(goodput["disaggregated"] / goodput["colocated"])
    table = format_compare(result)
    assert "goodput disaggregated / colocated:" in table and "6/6" in table
