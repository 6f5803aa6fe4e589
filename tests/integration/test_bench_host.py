"""``tandem bench host``: its flags are checked before anything starts, and its decode part, on a
real deployment of one-rank groups, reports the client's ITL against the bare forward and the
decode rank's own step split."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from tandem.bench.host_bench import add_arguments, check_args, format_host, run_host_bench
from tandem.wire.request_params import InvalidRequestError


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--parts", "decode,gpu"], "--parts: expected some of decode, frontend, transfer"),
        (["--concurrency", "1,x"], "--concurrency: expected comma-separated integers"),
        (["--concurrency", "0"], "--concurrency: expected integers of at least 1"),
        (["--streams", "64"], "--streams: must include 256"),
        (["--size-mib", "0"], "--size-mib: must be at least 1"),
        (["--model", "/no/such/model"], "--model: /no/such/model: model directory does not exist"),
    ],
)
def test_bad_flags_are_refused_by_name(argv: list[str], message: str) -> None:
    with pytest.raises(InvalidRequestError, match=message):
        check_args(_args(*argv))


def test_the_command_refuses_a_bad_flag_before_starting_ray() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "bench", "host", "--parts", "nothing"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 2 and result.stderr.startswith("tandem: error: --parts:"), result.stderr


def test_the_decode_part_measures_itl_against_the_bare_forward() -> None:
    args = _args("--parts", "decode", "--concurrency", "1,2", "--output-tokens", "12")
    own = os.sched_getaffinity(0)
    result = run_host_bench(args)
    json.dumps(result)  # the --json object
    # the decode rank on a core of its own, the frontend and the client on the rest, and this
    # process back on its cores afterwards
    total = os.cpu_count() or 1
    if total >= 2:
        assert result["decode"]["cores"] == {"decode_rank": (1,), "frontend": (0, *range(2, total))}
    assert os.sched_getaffinity(0) == own
    points = result["decode"]["points"]
    assert [p["concurrency"] for p in points] == [1, 2]
    assert result["decode_itl_over_forward"] == points[0]["itl_over_forward"]
    for point in points:
        assert point["itl_p50_ms"] > 0 and point["bare_forward_ms"] > 0
        ratio = point["itl_p50_ms"] / point["bare_forward_ms"]
        assert point["itl_over_forward"] == pytest.approx(ratio, 0.01)
        # the point is the median of its alternating bare and served rounds
        rounds = point["rounds_itl_over_forward"]
        assert len(rounds) == 3 and sorted(rounds)[1] == point["itl_over_forward"]
        split = point["decode_step"]
        # the rank stepped this point's requests (rounds x concurrency, 11 gaps each at least)
        assert split["steps"] >= 11
        assert split["forward_ms"] > 0 and split["sampling_ms"] > 0 and split["token_push_ms"] > 0
        assert split["step_ms"] >= split["forward_ms"]
        loop = split["step_ms"] + split["tick_ms"] + split["token_push_ms"]
        assert split["loop_over_forward"] == pytest.approx(loop / split["forward_ms"], 0.01)
    assert "decode_itl_over_forward" in format_host(result)
