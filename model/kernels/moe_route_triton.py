"""``noaux_tc`` grouped top-k routing in Triton. One program routes ``BLOCK_T`` tokens, each
token's whole row of experts held in registers::

    router_logits [T, E] --sigmoid--> scores --(+ correction_bias [E])--> biased
                                                                            |
    experts in n_group contiguous groups of E / n_group:                    v
      | g0: e0 .. e31 | g1: e32 .. e63 | ... | g7: e224 .. e255 |   group score = sum of the
                                                                    group's two best biased
    keep the topk_group best groups, mask every other expert to -inf, then take the top_k best
    biased experts by repeated masked argmax (a tie goes to the lower expert id)

    weights [T, top_k] float32 = unbiased scores of the chosen experts
                                 (/ (their sum + 1e-20) if norm_topk_prob) * routed_scaling_factor
    ids     [T, top_k] int64   = chosen experts, best biased score first

``top_k`` and ``topk_group`` are small (8 and 4 for DeepSeek-V3), so each selection is a short
unrolled loop of row reductions; nothing is sorted.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Elements of one program's [BLOCK_T, BLOCK_E] tiles: 8 tokens x 256 experts on 4 warps fit in
# registers at sm_90 (124 per thread, no spills).
_TILE_ELEMENTS = 2048
_MAX_BLOCK_T = 64


class RoutingShapeError(ValueError):
    """The routing settings cannot select ``top_k`` experts from ``E`` router logits."""


@triton.jit
def route_rows(
    logits,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    offs_t,
    num_tokens,
    num_experts,
    routed_scaling_factor,
    EXPERTS_PER_GROUP: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    NORM_TOPK_PROB: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    """Route the float32 logits ``[BLOCK_T, BLOCK_E]`` of tokens ``offs_t`` (columns past
    ``num_experts`` are padding, whatever they hold) and store their weights and ids."""
    offs_e = tl.arange(0, BLOCK_E)
    offs_g = tl.arange(0, BLOCK_G)
    offs_k = tl.arange(0, BLOCK_K)
    t_ok = offs_t < num_tokens
    e_ok = offs_e < num_experts
    group_of_e = offs_e // EXPERTS_PER_GROUP  # >= N_GROUP on padding columns: in no group

    scores = tl.sigmoid(logits)
    bias = tl.load(bias_ptr + offs_e, mask=e_ok, other=0.0).to(tl.float32)
    biased = scores + bias[None, :]
    neg_inf = float("-inf")

    # group score: the best biased score of the group plus the second best (which may tie it)
    group_scores = tl.full((BLOCK_T, BLOCK_G), neg_inf, tl.float32)
    for g in tl.static_range(N_GROUP):
        in_group = (group_of_e == g)[None, :]
        member = tl.where(in_group, biased, neg_inf)
        best = tl.max(member, axis=1)
        best_e = tl.min(tl.where(member == best[:, None], offs_e[None, :], BLOCK_E), axis=1)
        second = tl.max(tl.where(offs_e[None, :] == best_e[:, None], neg_inf, member), axis=1)
        group_scores = tl.where(offs_g[None, :] == g, (best + second)[:, None], group_scores)

    allowed = tl.zeros((BLOCK_T, BLOCK_E), tl.int1)
    for _ in tl.static_range(TOPK_GROUP):
        best = tl.max(group_scores, axis=1)
        best_g = tl.min(tl.where(group_scores == best[:, None], offs_g[None, :], BLOCK_G), axis=1)
        allowed = allowed | (group_of_e[None, :] == best_g[:, None])
        group_scores = tl.where(offs_g[None, :] == best_g[:, None], neg_inf, group_scores)

    candidates = tl.where(allowed, biased, neg_inf)
    top_weights = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    top_ids = tl.zeros((BLOCK_T, BLOCK_K), tl.int64)
    for k in tl.static_range(TOP_K):
        best = tl.max(candidates, axis=1)
        best_e = tl.min(tl.where(candidates == best[:, None], offs_e[None, :], BLOCK_E), axis=1)
        chosen = offs_e[None, :] == best_e[:, None]
        weight = tl.sum(tl.where(chosen, scores, 0.0), axis=1)
        top_weights = tl.where(offs_k[None, :] == k, weight[:, None], top_weights)
        top_ids = tl.where(offs_k[None, :] == k, best_e.to(tl.int64)[:, None], top_ids)
        candidates = tl.where(chosen, neg_inf, candidates)

    if NORM_TOPK_PROB:
        top_weights = top_weights / (tl.sum(top_weights, axis=1)[:, None] + 1e-20)
    top_weights = top_weights * routed_scaling_factor

    out_offs = offs_t[:, None] * TOP_K + offs_k[None, :]
    out_mask = t_ok[:, None] & (offs_k < TOP_K)[None, :]
    tl.store(weights_ptr + out_offs, top_weights, mask=out_mask)
    tl.store(ids_ptr + out_offs, top_ids, mask=out_mask)


@triton.jit
def _grouped_topk_kernel(
    logits_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    num_experts,
    logits_stride,
    routed_scaling_factor,
    EXPERTS_PER_GROUP: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    NORM_TOPK_PROB: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    t_ok = offs_t < num_tokens
    e_ok = offs_e < num_experts
    logits = tl.load(
        logits_ptr + offs_t[:, None] * logits_stride + offs_e[None, :],
        mask=t_ok[:, None] & e_ok[None, :],
        other=0.0,
    ).to(tl.float32)
    route_rows(
        logits,
        bias_ptr,
        weights_ptr,
        ids_ptr,
        offs_t,
        num_tokens,
        num_experts,
        routed_scaling_factor,
        EXPERTS_PER_GROUP,
        N_GROUP,
        TOPK_GROUP,
        TOP_K,
        NORM_TOPK_PROB,
        BLOCK_T,
        BLOCK_E,
        BLOCK_G,
        BLOCK_K,
    )


def check_routing_shape(num_experts: int, top_k: int, n_group: int, topk_group: int) -> None:
    if n_group < 1 or num_experts % n_group:
        raise RoutingShapeError(f"n_group={n_group} must divide the {num_experts} router logits")
    if not 1 <= topk_group <= n_group:
        raise RoutingShapeError(f"topk_group={topk_group} must lie in 1..n_group={n_group}")
    if not 1 <= top_k <= topk_group * (num_experts // n_group):
        raise RoutingShapeError(
            f"top_k={top_k} must lie in 1..{topk_group * (num_experts // n_group)}, "
            f"the experts in topk_group={topk_group} groups"
        )


def tokens_per_program(num_tokens: int, num_experts: int) -> int:
    block_e = triton.next_power_of_2(num_experts)
    return min(max(1, _TILE_ELEMENTS // block_e), _MAX_BLOCK_T, triton.next_power_of_2(num_tokens))


def launch_grouped_topk(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    weights_out: torch.Tensor,
    ids_out: torch.Tensor,
) -> None:
    """Route into ``weights_out [T, top_k]`` (float32) and ``ids_out [T, top_k]`` (int64), both
    contiguous; every element is written."""
    num_tokens, num_experts = router_logits.shape
    check_routing_shape(num_experts, top_k, n_group, topk_group)
    assert weights_out.shape == ids_out.shape == (num_tokens, top_k)
    assert weights_out.dtype == torch.float32 and ids_out.dtype == torch.int64
    assert weights_out.is_contiguous() and ids_out.is_contiguous()
    if num_tokens == 0:
        return
    logits = router_logits if router_logits.stride(-1) == 1 else router_logits.contiguous()
    block_t = tokens_per_program(num_tokens, num_experts)
    _grouped_topk_kernel[(triton.cdiv(num_tokens, block_t),)](
        logits,
        correction_bias.contiguous(),
        weights_out,
        ids_out,
        num_tokens,
        num_experts,
        logits.stride(0),
        float(routed_scaling_factor),
        EXPERTS_PER_GROUP=num_experts // n_group,
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        NORM_TOPK_PROB=bool(norm_topk_prob),
        BLOCK_T=block_t,
        BLOCK_E=triton.next_power_of_2(num_experts),
        BLOCK_G=triton.next_power_of_2(n_group),
        BLOCK_K=triton.next_power_of_2(top_k),
        num_warps=4,
    )


def grouped_topk_triton(
    router_logits: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``noaux_tc`` grouped top-k: ``(weights [T, top_k] float32, expert ids [T, top_k] int64)``."""
    num_tokens = router_logits.shape[0]
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=router_logits.device)
    launch_grouped_topk(
        router_logits,
        correction_bias,
        top_k,
        n_group,
        topk_group,
        norm_topk_prob,
        routed_scaling_factor,
        weights,
        ids,
    )
    return weights, ids
