"""Block-scaled FP8 (DeepSeek-V3's release format) kept as it is: the torch references.

A weight ``[out, in]`` is float8 e4m3 with one float32 ``scale_inv`` per ``bo x bi`` block
(``weight ~= fp8 * scale_inv``, edge blocks partial). A fused gate/up expert weight stacks two
such matrices, gate rows then up rows, and their scales the same way, so when the intermediate
size is not a multiple of ``bo`` the up half's scales start on a fresh row::

    w_gate_up [2I, D]  fp8            w_gate_up_scale [2 * ceil(I/bo), ceil(D/bi)]
    rows 0 .. I-1    gate             rows 0 .. ceil(I/bo)-1              gate's blocks
    rows I .. 2I-1   up               rows ceil(I/bo) .. 2*ceil(I/bo)-1   up's blocks

Two ways to multiply activations by such a weight, both checked against the dequantised one:

- ``dequant``: each weight tile is scaled into the activation dtype and multiplied there; the
  result is the dequantised model's up to summation order (the exact path, for golden tokens).
- ``quant``: activations are quantised per ``1 x bi`` group of each row (DeepSeek's inference
  recipe) and both FP8 operands go through FP8 tensor cores, each partial product scaled by
  the activation group's and the weight block's scales.
"""

from __future__ import annotations

import math
import os
from typing import Literal

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
DEFAULT_BLOCK = (128, 128)
Fp8Mode = Literal["dequant", "quant"]
FP8_MODES: tuple[Fp8Mode, ...] = ("dequant", "quant")


def fp8_mode() -> Fp8Mode:
    """``TANDEM_FP8_ACTIVATIONS`` (``dequant`` or ``quant``); ``dequant`` when unset."""
    value = os.environ.get("TANDEM_FP8_ACTIVATIONS") or "dequant"
    if value not in FP8_MODES:
        raise ValueError(f"TANDEM_FP8_ACTIVATIONS={value!r} is not one of {list(FP8_MODES)}")
    return value


def scale_shape(out_dim: int, in_dim: int, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(out_dim / block[0]), math.ceil(in_dim / block[1])


def dequantize_fp8_block(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> torch.Tensor:
    """``weight.float() * scale_inv`` with each scale broadcast over its ``block`` (edge blocks partial)."""
    out_dim, in_dim = weight.shape
    scale = scale_inv.float().repeat_interleave(block[0], dim=0)[:out_dim]
    scale = scale.repeat_interleave(block[1], dim=1)[:, :in_dim]
    return weight.float() * scale


def quantize_fp8_block(
    weight: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-wise FP8 e4m3 quantisation: returns ``(fp8 weight, fp32 scale_inv)``, the inverse of
    :func:`dequantize_fp8_block`. Each block's scale maps its largest magnitude onto 448."""
    out_dim, in_dim = weight.shape
    bo, bi = block
    rows, cols = scale_shape(out_dim, in_dim, block)
    padded = torch.zeros(rows * bo, cols * bi, dtype=torch.float32, device=weight.device)
    padded[:out_dim, :in_dim] = weight.float()
    amax = padded.view(rows, bo, cols, bi).abs().amax(dim=(1, 3))
    # An all-zero block has no range to map; any positive scale quantises it exactly.
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    full_scale = scale.repeat_interleave(bo, dim=0).repeat_interleave(bi, dim=1)
    quantized = (padded / full_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized[:out_dim, :in_dim].contiguous(), scale


def dequantize_gate_up(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_BLOCK
) -> torch.Tensor:
    """A fused ``[2I, D]`` gate/up weight (the layout in this module's docstring) in float32."""
    inter = weight.shape[0] // 2
    half = math.ceil(inter / block[0])
    gate = dequantize_fp8_block(weight[:inter], scale_inv[:half], block)
    up = dequantize_fp8_block(weight[inter:], scale_inv[half:], block)
    return torch.cat([gate, up])


def quantize_activation_groups(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row of ``x [M, K]`` quantised per ``group`` columns:
    ``(fp8 [M, K], scale [M, ceil(K/group)])``."""
    rows, cols = x.shape
    groups = math.ceil(cols / group)
    padded = F.pad(x.float(), (0, groups * group - cols)).view(rows, groups, group)
    amax = padded.abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = (padded / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.view(rows, groups * group)[:, :cols].contiguous(), scale


def fp8_linear_torch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    mode: Fp8Mode = "dequant",
) -> torch.Tensor:
    """``x @ dequant(weight)^T (+ bias)`` in ``x``'s dtype, by ``mode`` (see the module docstring)."""
    if mode == "dequant":
        return F.linear(x, dequantize_fp8_block(weight, scale_inv, block).to(x.dtype), bias)
    lead, cols = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, cols)
    xq, xs = quantize_activation_groups(flat, block[1])
    out = quantized_matmul(xq, xs, weight, scale_inv, block)
    if bias is not None:
        out += bias.float()
    return out.to(x.dtype).reshape(*lead, weight.shape[0])


def quantized_matmul(
    xq: torch.Tensor, xs: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> torch.Tensor:
    """``quant`` mode's product in float32, as the kernels form it: per ``bi``-wide step of K,
    the FP8 x FP8 partial product scaled by the activation group's and the weight block's scales.

    ``xq [M, K]`` and ``xs [M, ceil(K/bi)]`` come from :func:`quantize_activation_groups`."""
    cols = xq.shape[1]
    out = torch.zeros(xq.shape[0], weight.shape[0], dtype=torch.float32, device=xq.device)
    row_scale = scale_inv.float().repeat_interleave(block[0], dim=0)[: weight.shape[0]]
    for kb, k0 in enumerate(range(0, cols, block[1])):
        part = xq[:, k0 : k0 + block[1]].float() @ weight[:, k0 : k0 + block[1]].float().T
        out += part * xs[:, kb, None] * row_scale[None, :, kb]
    return out
