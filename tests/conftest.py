"""Test-wide settings.

Triton kernels run in Triton's interpreter on machines without a CUDA GPU; the interpreter is
chosen when a kernel is defined, so it is set here before any kernel module is imported.
Kernel tests marked ``kernels_full`` (every shape) run only with ``TANDEM_FULL_KERNEL_TESTS=1``;
CI runs a representative subset.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("TANDEM_FULL_KERNEL_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="full kernel shape set: set TANDEM_FULL_KERNEL_TESTS=1")
    for item in items:
        if "kernels_full" in item.keywords:
            item.add_marker(skip)
