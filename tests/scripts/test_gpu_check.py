"""``scripts/gpu-check.sh`` run with a stand-in interpreter: a check that fails fails the script
(after the others have run), and one that passes everywhere passes it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent.parent


def _stand_in(tmp_path: Path, failing: str | None) -> Path:
    """An interpreter that passes the CUDA probe (``-c``), logs each module it is asked to run,
    and exits 3 for the ``failing`` one."""
    log = tmp_path / "ran.log"
    python = tmp_path / "python"
    python.write_text(
        "#!/usr/bin/env bash\n"
        '[ "$1" = "-c" ] && exit 0\n'
        f'echo "$2" >> {log}\n'
        f'[ "$2" = "{failing}" ] && exit 3\n'
        "exit 0\n"
    )
    python.chmod(0o755)
    return python


def _run(python: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": str(python)}
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu-check.sh")], env=env, capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    "failing",
    [
        "tandem.bench.gpu_model_check",
        "tandem.bench.gpu_transfer_check",
        "tandem.bench.gpu_decode_check",
        "tandem.bench.gpu_check",
    ],
)
def test_a_failing_check_fails_the_script_after_every_check_ran(tmp_path: Path, failing: str) -> None:
    done = _run(_stand_in(tmp_path, failing))
    assert done.returncode == 1, done.stderr
    assert "FAILED" in done.stderr and "(exit 3)" in done.stderr
    ran = (tmp_path / "ran.log").read_text().split()
    assert ran == [
        "tandem.bench.gpu_model_check",
        "tandem.bench.gpu_transfer_check",
        "tandem.bench.gpu_decode_check",
        "tandem.bench.gpu_check",
    ]


def test_every_check_passing_passes_the_script(tmp_path: Path) -> None:
    done = _run(_stand_in(tmp_path, None))
    assert done.returncode == 0, done.stderr
    assert "every check passed" in done.stdout
