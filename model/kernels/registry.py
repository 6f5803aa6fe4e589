"""Kernel backends by name: the built-in ``torch`` and ``triton`` ones (imported only when asked
for: ``triton`` on a machine without CUDA must switch Triton's interpreter on before its kernels
are defined) and any other a module registers with ``register_backend``."""

from __future__ import annotations

import os

import torch

from tandem.model.kernels.backend import KernelBackend

_REGISTRY: dict[str, type[KernelBackend]] = {}


def register_backend(cls: type[KernelBackend]) -> type[KernelBackend]:
    _REGISTRY[cls.name] = cls
    return cls


class UnknownKernelBackend(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"TANDEM_KERNELS={name!r} is not a kernel backend; known: {sorted(_REGISTRY)}")


def get_backend(device: torch.device | str = "cpu", name: str | None = None) -> KernelBackend:
    """The backend named by ``name`` or ``TANDEM_KERNELS``; else ``triton`` on CUDA, ``torch`` elsewhere.

    ``triton`` on a machine without CUDA runs the kernels in Triton's interpreter: it is chosen when
    a kernel is defined, so it is switched on here, before the kernel modules are imported.
    """
    from tandem.model.kernels.torch_backend import TorchBackend

    _REGISTRY.setdefault(TorchBackend.name, TorchBackend)

    is_cuda = torch.device(device).type == "cuda"
    chosen = name or os.environ.get("TANDEM_KERNELS") or ("triton" if is_cuda else "torch")
    if chosen == "triton" and chosen not in _REGISTRY:
        if not is_cuda:
            os.environ["TRITON_INTERPRET"] = "1"
        from tandem.model.kernels.triton_backend import TritonBackend

        _REGISTRY.setdefault(TritonBackend.name, TritonBackend)
    if chosen not in _REGISTRY:
        raise UnknownKernelBackend(chosen)
    return _REGISTRY[chosen]()
