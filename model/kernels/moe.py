"""MoE routing (``noaux_tc`` grouped top-k) and the expert computation (torch references)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.model.kernels.fp8 import dequantize_fp8_block, dequantize_gate_up


@dataclass(frozen=True)
class ExpertScales:
    """The block scales of FP8 experts (``kernels/fp8.py``): ``gate_up [E, 2 * ceil(I/bo),
    ceil(D/bi)]`` (gate's rows, then up's) and ``down [E, ceil(D/bo), ceil(I/bi)]``."""

    gate_up: torch.Tensor
    down: torch.Tensor
    block: tuple[int, int]


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


def fused_experts_torch(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    first_expert: int,
    scales: ExpertScales | None = None,
) -> torch.Tensor:
    """With ``scales`` the experts are FP8; each used one is dequantised into ``x``'s dtype."""
    out = torch.zeros_like(x)
    num_local, two_inter, _ = w_gate_up.shape
    local_ids = topk_ids - first_expert
    for expert in torch.unique(local_ids).tolist():
        if not 0 <= expert < num_local:
            continue
        token_idx, slot = torch.where(local_ids == expert)
        w13, w2 = w_gate_up[expert], w_down[expert]
        if scales is not None:
            w13 = dequantize_gate_up(w13, scales.gate_up[expert], scales.block).to(x.dtype)
            w2 = dequantize_fp8_block(w2, scales.down[expert], scales.block).to(x.dtype)
        h = F.linear(x[token_idx], w13)
        gate, up = h.split(two_inter // 2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2)
        y = y * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out
