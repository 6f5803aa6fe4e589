"""MoE routing (``noaux_tc`` grouped top-k) and the expert computation (torch references)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


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
) -> torch.Tensor:
    out = torch.zeros_like(x)
    num_local, two_inter, _ = w_gate_up.shape
    local_ids = topk_ids - first_expert
    for expert in torch.unique(local_ids).tolist():
        if not 0 <= expert < num_local:
            continue
        token_idx, slot = torch.where(local_ids == expert)
        h = F.linear(x[token_idx], w_gate_up[expert])
        gate, up = h.split(two_inter // 2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[expert])
        y = y * topk_weights[token_idx, slot, None]
        out.index_add_(0, token_idx, y.to(out.dtype))
    return out
