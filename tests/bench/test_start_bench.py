"""``tandem bench start``'s report and its checks of the command line (the run itself starts
deployments for minutes: a benchmark, not a test)."""

from __future__ import annotations

import pytest

from tandem.bench.start_bench import MODES, format_start
from tandem.cli.main import main


def _run(mode: str, serving_s: float, ttft: list[float]) -> dict[str, object]:
    return {
        "preset": "local",
        "ranks": 4,
        "groups": 2,
        "mode": mode,
        "ray_s": 2.0,
        "serving_s": serving_s,
        "ttft_s": ttft,
        "kv_wait_s": [t / 2 for t in ttft],
        "first_over_rest": ttft[0] / sorted(ttft[1:])[len(ttft[1:]) // 2],
        "add_group": {"group": "prefill1", "ready_s": 3.0, "first_served_s": None, "first_ttft_s": None},
    }


def test_each_start_is_reported_against_the_first_mode_of_its_preset() -> None:
    modes = list(MODES)
    slow, fast = modes[0], modes[-1]
    ttft = [0.2, *([0.05] * 9)]
    runs = [_run(slow, 8.0, ttft), _run(fast, 6.0, ttft)]
    report = format_start({"requests": 10, "prompt_tokens": 512, "max_tokens": 4, "runs": runs})
    rows = [line for line in report.splitlines() if line.startswith("| local")]
    assert len(rows) == 2
    assert "| 8.0 s | 1.00 | 200 ms | 50 ms | 4.00 | 100 / 25 ms | 3.0 s | not routed there |" in rows[0]
    assert f"| {fast} | 6.0 s | 0.75 |" in rows[1]


BAD = [
    (["--requests", "0"], "--requests"),
    (["--prompt-tokens", "0"], "--prompt-tokens"),
    (["--max-tokens", "0"], "--max-tokens"),
    (["--preset", "nope"], "--preset"),
]


@pytest.mark.parametrize(("argv", "field"), BAD)
def test_bad_arguments_name_their_flag(
    argv: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", "start", *argv]) != 0
    assert field in capsys.readouterr().err
