"""``tandem bench soak``, short: requests through the gRPC port with some cancelled at random
points; each completes with the colocated engine's tokens or was cancelled, every page is free,
the accounting holds, and no process of the deployment grows over the second half."""

from __future__ import annotations

import json
import subprocess
import sys


def test_a_short_soak_completes_or_cancels_every_request_and_leaves_nothing() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "tandem.cli", "bench", "soak", "--requests", "120", "--concurrency", "12",
         "--cancel-fraction", "0.2"],
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(result.stdout.strip().splitlines()[-1])
    assert report["completed"] + report["cancelled"] == 120 and report["wrong"] == 0, report
    assert report["cancelled"] > 0 and report["completed"] > 0
    assert report["pages_free"] and report["integrity"] == "ok"
    # six processes: controller, frontend, two prefill and two decode ranks
    assert len(report["rss_growth_second_half_mib"]) == 6 and report["ok"]


def test_soak_refuses_bad_arguments_in_one_line() -> None:
    for args, message in [
        (["--requests", "0"], "--requests: must be at least 1"),
        (["--cancel-fraction", "2"], "--cancel-fraction: must be in [0, 1], got 2.0"),
    ]:
        result = subprocess.run(
            [sys.executable, "-m", "tandem.cli", "bench", "soak", *args],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert result.returncode == 2 and result.stderr.strip() == f"tandem: error: {message}", result.stderr
