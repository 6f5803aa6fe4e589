"""MoE routing (``noaux_tc`` grouped top-k) and the expert computation (torch references)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.nn.functional as F

from tandem.model.kernels.fp4 import FP4_GROUP, dequantize_fp4
from tandem.model.kernels.fp8 import (
    Fp8Mode,
    dequantize_fp8_block,
    dequantize_gate_up,
    fp8_mode,
    quantize_activation_groups,
    quantized_matmul,
)


@dataclass(frozen=True)
class ExpertScales:
    """The block scales of FP8 experts (``kernels/fp8.py``): ``gate_up [E, 2 * ceil(I/bo),
    ceil(D/bi)]`` (gate's rows, then up's) and ``down [E, ceil(D/bo), ceil(I/bi)]``; ``mode``,
    how activations meet them (``TANDEM_FP8_ACTIVATIONS`` when these scales are made).

    ``fmt`` ``fp4``: FP4 experts (``kernels/fp4.py``), the weights bytes ``[E, 2I, D/2]`` and
    ``[E, D, I/2]``, the scales E8M0 bytes ``gate_up [E, 2I, D/32]`` and ``down [E, D, I/32]``
    (``block`` ``(1, 32)``), always dequantised per tile into the activations' dtype."""

    gate_up: torch.Tensor
    down: torch.Tensor
    block: tuple[int, int]
    mode: Fp8Mode = field(default_factory=fp8_mode)
    fmt: Literal["fp8", "fp4"] = "fp8"

    @staticmethod
    def fp4(gate_up: torch.Tensor, down: torch.Tensor) -> ExpertScales:
        return ExpertScales(gate_up, down, (1, FP4_GROUP), "dequant", "fp4")


def grouped_topk_torch(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick ``topk_group`` groups by the sum of each group's two best biased scores, then the
    ``top_k`` best biased scores inside them; weights are the *unbiased* sigmoid scores."""
    scores = router_logits.sigmoid()
    num_tokens, num_experts = scores.shape
    biased = scores + correction_bias
    group_scores = biased.view(num_tokens, n_group, num_experts // n_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
    expert_mask = (
        group_mask[:, :, None].expand(-1, -1, num_experts // n_group).reshape(num_tokens, num_experts)
    )
    biased = biased.masked_fill(expert_mask == 0, float("-inf"))
    topk_ids = torch.topk(biased, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, topk_ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, topk_ids


def clip_gate_up(gate: torch.Tensor, up: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V4's clipped SwiGLU inputs: the gate from above, the up on both sides."""
    return gate.clamp(max=limit), up.clamp(min=-limit, max=limit)


def fused_experts_torch(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    first_expert: int,
    scales: ExpertScales | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """With ``scales`` the experts are FP8 or FP4 (``scales.fmt``): in ``dequant`` mode each used
    one is dequantised into ``x``'s dtype; in ``quant`` mode (FP8) see :func:`_quant_expert`.
    ``swiglu_limit``: see :func:`clip_gate_up`."""
    if swiglu_limit is not None and scales is not None and scales.mode == "quant":
        raise ValueError("clipped experts (swiglu_limit) run in dequant mode, not quant")
    out = torch.zeros_like(x)
    num_local, two_inter, _ = w_gate_up.shape
    local_ids = topk_ids - first_expert
    for expert in torch.unique(local_ids).tolist():
        if not 0 <= expert < num_local:
            continue
        token_idx, slot = torch.where(local_ids == expert)
        if scales is not None and scales.mode == "quant":
            y = _quant_expert(x[token_idx], w_gate_up[expert], w_down[expert], scales, expert)
        else:
            w13, w2 = w_gate_up[expert], w_down[expert]
            if scales is not None and scales.fmt == "fp4":
                w13 = dequantize_fp4(w13, scales.gate_up[expert]).to(x.dtype)
                w2 = dequantize_fp4(w2, scales.down[expert]).to(x.dtype)
            elif scales is not None:
                w13 = dequantize_gate_up(w13, scales.gate_up[expert], scales.block).to(x.dtype)
                w2 = dequantize_fp8_block(w2, scales.down[expert], scales.block).to(x.dtype)
            gate, up = F.linear(x[token_idx], w13).split(two_inter // 2, dim=-1)
            if swiglu_limit is not None:
                gate, up = clip_gate_up(gate, up, swiglu_limit)
            y = F.linear(F.silu(gate) * up, w2)
        y = y * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out


def _quant_expert(
    x: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, scales: ExpertScales, expert: int
) -> torch.Tensor:
    """One FP8 expert in ``quant`` mode, in float32, quantising where the Triton kernels do:
    ``x`` per ``1 x bi`` group of D, then ``h = silu(gate) * up`` (float32, never rounded to
    ``x``'s dtype) per ``1 x bi`` group of I; both products FP8 x FP8 per ``bi`` step."""
    block = scales.block
    inter = w_gate_up.shape[0] // 2
    half = math.ceil(inter / block[0])
    s_gate_up = scales.gate_up[expert]
    xq, xs = quantize_activation_groups(x, block[1])
    gate = quantized_matmul(xq, xs, w_gate_up[:inter], s_gate_up[:half], block)
    up = quantized_matmul(xq, xs, w_gate_up[inter:], s_gate_up[half:], block)
    hq, hs = quantize_activation_groups(gate * torch.sigmoid(gate) * up, block[1])
    return quantized_matmul(hq, hs, w_down, scales.down[expert], block)
