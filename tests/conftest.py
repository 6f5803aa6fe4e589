"""Test-wide settings.

Triton kernels run in Triton's interpreter on machines without a CUDA GPU; the interpreter is
chosen when a kernel is defined, so it is set here before any kernel module is imported.
Kernel tests marked ``kernels_full`` (every shape) run only with ``TANDEM_FULL_KERNEL_TESTS=1``;
CI runs a representative subset.
"""

from __future__ import annotations

import os
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
