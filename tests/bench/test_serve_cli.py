"""``tandem bench serve``'s refusals: one line on stderr, the flag named; no deployment needed."""

from __future__ import annotations

import socket
import subprocess
import sys


def _tandem(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", "bench", "serve", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def _closed_port() -> int:
    with socket.socket() as sock:  # bound, then released: nothing listens there
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_an_unreachable_deployment_is_one_line() -> None:
    port = _closed_port()
    result = _tandem("--addr", f"127.0.0.1:{port}", "--concurrency", "1")
    assert result.returncode == 1 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith(
        f"tandem: error: no Tandem deployment answers at 127.0.0.1:{port}: UNAVAILABLE"
    )


def test_bad_options_name_the_flag() -> None:
    for args, message in [
        (["--concurrency", "1,0"], "--concurrency: each must be at least 1, got '1,0'"),
        (["--concurrency", "a"], "--concurrency: expected comma-separated integers, got 'a'"),
        (["--shared-prefix-tokens", "300"], "--shared-prefix-tokens: 300 is longer than --prompt-tokens 256"),
        (
            ["--trace", "/nonexistent.jsonl"],
            "--trace: cannot read trace /nonexistent.jsonl: No such file or directory",
        ),
        (["--slo-itl-ms", "0"], "--slo-itl-ms: must be > 0, got 0.0"),
        (["--gpu-hour-price", "-2"], "--gpu-hour-price: must be > 0, got -2.0"),
        (["--cached-token-weight", "1.5"], "--cached-token-weight: must be in [0, 1], got 1.5"),
    ]:
        result = _tandem("--addr", "127.0.0.1:1", *args)
        assert result.returncode == 2 and result.stderr.strip() == f"tandem: error: {message}", result.stderr
