"""DeepSeek-V4's projections: in the activation dtype, or, from an FP8 checkpoint, FP8 with their
block scales (``<name>_scale``, float32), multiplied as they lie by the kernel backend's
``fp8_linear`` (``kernels/fp8.py``; ``TANDEM_FP8_ACTIVATIONS`` picks its mode)."""

from __future__ import annotations

import torch
from torch import nn

from tandem.model.kernels.backend import KernelBackend
from tandem.model.kernels.fp8 import FP8_DTYPE, Fp8Mode, fp8_mode, scale_shape


def add_weight(
    module: nn.Module,
    name: str,
    out_dim: int,
    in_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    block: tuple[int, int] | None,
) -> None:
    """Register ``name [out_dim, in_dim]`` on ``module``: FP8 with ``name + "_scale"`` when
    ``block`` is set."""
    weight = torch.empty(out_dim, in_dim, dtype=FP8_DTYPE if block else dtype, device=device)
    module.register_parameter(name, nn.Parameter(weight, requires_grad=False))
    if block:
        scales = torch.empty(*scale_shape(out_dim, in_dim, block), dtype=torch.float32, device=device)
        module.register_parameter(name + "_scale", nn.Parameter(scales, requires_grad=False))


class Projections:
    """How a module multiplies by its weights: ``block`` (FP8 block size) or ``None``."""

    def __init__(self, block: tuple[int, int] | None) -> None:
        self.block = block
        self.mode: Fp8Mode = fp8_mode() if block else "dequant"

    def __call__(self, module: nn.Module, name: str, x: torch.Tensor, ops: KernelBackend) -> torch.Tensor:
        """``x @ weight^T`` for ``module``'s weight ``name``."""
        weight = getattr(module, name)
        if self.block is None:
            return x @ weight.t()
        return ops.fp8_linear(x, weight, getattr(module, name + "_scale"), self.block, None, self.mode)

    def grouped(
        self, module: nn.Module, name: str, x: torch.Tensor, groups: int, ops: KernelBackend
    ) -> torch.Tensor:
        """``x [G, T, in]`` -> ``[G, T, out / G]``: group ``g`` times the ``g``-th row block of
        weight ``name [out, in]`` (an FP8 weight's row blocks are whole scale blocks)."""
        weight = getattr(module, name)
        rows = weight.shape[0] // groups
        if self.block is None:
            return torch.bmm(x, weight.view(groups, rows, -1).transpose(1, 2))
        scales = getattr(module, name + "_scale")
        per = rows // self.block[0]
        return torch.stack(
            [
                ops.fp8_linear(
                    x[g],
                    weight[g * rows : (g + 1) * rows],
                    scales[g * per : (g + 1) * per],
                    self.block,
                    None,
                    self.mode,
                )
                for g in range(groups)
            ]
        )
