"""``tandem bench engine`` reports what it promises (figures are not asserted: this is no timing test)."""

from __future__ import annotations

from pathlib import Path

from tandem.bench.engine_bench import run_engine_bench
from tandem.model.make_tiny import make_tiny_checkpoint


def test_engine_bench_reports_each_batch(tmp_path: Path) -> None:
    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    result = run_engine_bench(tiny, prompt_tokens=8, output_tokens=4, batch_sizes=[1, 3])
    runs = result["runs"]
    assert [r["batch"] for r in runs] == [1, 3]
    for run in runs:
        assert run["decode_steps"] == 3  # the first output token comes from the prefill step
        assert run["output_tokens_per_s"] > 0
        assert 0.0 < run["decode_outside_forward_share"] < 1.0
        assert 0.0 <= run["decode_sampling_share"] < run["decode_outside_forward_share"]
