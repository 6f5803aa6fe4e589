"""Test-wide settings.

Triton kernels run in Triton's interpreter on machines without a CUDA GPU; the interpreter is
chosen when a kernel is defined, so it is set here before any kernel module is imported.
Kernel tests marked ``kernels_full`` (every shape) run only with ``TANDEM_FULL_KERNEL_TESTS=1``;
CI runs a representative subset.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem.model.make_tiny import make_tiny_checkpoint

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint of seed 0, made once for the tests that only read it."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("TANDEM_FULL_KERNEL_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="full kernel shape set: set TANDEM_FULL_KERNEL_TESTS=1")
    for item in items:
        if "kernels_full" in item.keywords:
            item.add_marker(skip)


_DEAD_PID = re.compile(r"\bpid[=: ]+(\d+)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A test that failed on a Ray worker that died gets that worker's last log lines (its
    stderr holds the fatal signal's traceback) as a report section: the process is gone by the
    time anyone reads the report, and so is the Ray session on a CI machine."""
    report = yield
    if report.failed and call.excinfo is not None:
        text = str(report.longrepr)
        if "died" in text and "Worker exit" in text:
            pids = sorted(set(_DEAD_PID.findall(text)))
            report.sections.append(("dead Ray workers' logs", _worker_logs(pids)))
    return report


def _worker_logs(pids: list[str], lines: int = 40) -> str:
    logs = Path(tempfile.gettempdir()) / "ray" / "session_latest" / "logs"
    out = []
    for pid in pids:
        paths = sorted(logs.glob(f"worker-*-{pid}.*")) + sorted(logs.glob(f"python-core-worker-*_{pid}.log"))
        for path in paths:
            tail = path.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {path.name}\n" + "\n".join(tail))
    raylet = logs / "raylet.out"
    if raylet.exists():
        hits = [ln for ln in raylet.read_text(errors="replace").splitlines() if any(p in ln for p in pids)]
        out.append("--- raylet.out (lines naming the pids)\n" + "\n".join(hits[-lines:]))
    return "\n".join(out) or f"no Ray logs for pids {pids} under {logs}"
