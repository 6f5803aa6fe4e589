"""A guard that a step's launch never waits for the device.

Between the launch of a step's forward and its sampling, nothing may bring a device value to the
host (``.tolist()``, ``.item()``, ``int(t)``, ``bool(t)``, ...): each such read makes the host wait
for every kernel queued before it, and a CUDA graph cannot hold one at all. The one wait of a
step is the sampled tokens.

``no_host_sync(device)`` guards a block:

- on a CUDA device, by CUDA's own account: ``torch.cuda.set_sync_debug_mode("error")``, so any
  synchronising call raises;
- on a CPU, where nothing is asynchronous, by a stand-in: the tensor methods that read a value
  onto the host raise :class:`HostSyncError` when Tandem's own code calls them inside the block
  (torch's and Triton's own code, e.g. Triton's interpreter, which reads every tensor through
  numpy, are theirs to run).
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

# Tandem's own source: the folders of the package (``router/`` is ``tandem.router``)
_ROOT = str(Path(__file__).resolve().parent.parent) + "/"
_READS = ("tolist", "item", "__int__", "__float__", "__bool__", "__index__", "numpy")


class HostSyncError(RuntimeError):
    def __init__(self, method: str, where: str) -> None:
        super().__init__(f"{where}: Tensor.{method} reads a device value on the host inside a step")
        self.method, self.where = method, where


def _own_caller() -> str | None:
    """``file:line`` of the caller two frames up, if it is Tandem's own code."""
    frame = sys._getframe(2)
    name = frame.f_code.co_filename
    if name.startswith(_ROOT) and "site-packages" not in name:
        return f"{str(Path(name).resolve())[len(_ROOT) :]}:{frame.f_lineno}"
    return None


def _guarded(method: str, original: Callable[..., Any]) -> Callable[..., Any]:
    def read(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        where = _own_caller()
        if where is not None:
            raise HostSyncError(method, where)
        return original(self, *args, **kwargs)

    return read


@contextlib.contextmanager
def no_host_sync(device: torch.device) -> Iterator[None]:
    """Fail any read of a device value onto the host inside the block (see the module)."""
    if device.type == "cuda":
        previous = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
        return
    originals = {name: getattr(torch.Tensor, name) for name in _READS}
    for name, original in originals.items():
        setattr(torch.Tensor, name, _guarded(name, original))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)
