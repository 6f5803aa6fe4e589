"""The MoE router GEMM fused with ``noaux_tc`` routing in Triton. One program takes ``BLOCK_T``
tokens, accumulates their logits over K tiles of the hidden size, then routes them in registers
with ``moe_route_triton.route_rows`` (the same code as the routing kernel); only the weights and
ids reach memory::

    x [T, D] (its own dtype)          gate_weight [E, D] float32
      | tile [BLOCK_T, BLOCK_K]         | tile [BLOCK_K, BLOCK_E] (transposed by the load)
      +--- widened to float32 ---+------+
                                 v
              logits [BLOCK_T, BLOCK_E] float32 += dot(x tile, w tile), K tiles in turn
                                 |
                                 v  route_rows: sigmoid, + bias, groups, top-k, renormalise
              weights [T, top_k] float32, ids [T, top_k] int64

Precision. Hugging Face's reference (and the ``torch`` backend) computes the logits as a float32
GEMM of the float32-widened activations; the dot here keeps full float32 precision
(``input_precision="ieee"``), not TF32. Routing needs it: TF32 keeps 10 mantissa bits of each
input, so a logit moves by the order of 1e-3 relative, enough to reorder two experts whose
biased scores lie that close, and a flipped expert sends the token through a different expert's MLP, changing
the layer's output by a whole expert's share rather than by a rounding error. The cost: an IEEE
float32 dot runs on the CUDA cores' FMAs, not the tensor cores (about 67 TFLOP/s on an H100 SXM
against about 495 for dense TF32), the same units the reference's cuBLAS float32 GEMM uses; at
prefill sizes (``2 * T * E * D`` flops, 15 GFLOP at T=4096) the kernel is bound by them.

What the fusion saves: the float32 copy of ``x`` (``T * D * 4`` bytes written and read again),
the logits' round trip through memory, and a launch. What it costs: every program streams the
whole ``E x D`` float32 weight (7.3 MB at DeepSeek-V3 shapes, from L2 after the first), and a
batch of ``T`` tokens keeps only ``ceil(T / BLOCK_T)`` programs busy, where cuBLAS would spread
one GEMM over every SM; at decode batch sizes that may well be slower than the two steps
(unmeasured: only a GPU can say; ``bench/gpu_check.py`` times both, ``moe_gate_route`` and
``moe_gate_route_two_steps``, at the decode and the MoE batch).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.model.kernels.moe_route_triton import check_routing_shape, route_rows

# tl.dot needs 16 rows at least; 16 tokens x 256 experts of float32 logits on 8 warps is what the
# routing kernel holds on 4 (8 x 256). Compiled for sm_90 at DeepSeek-V3 shapes (bf16 x):
#   BLOCK_T 16, BLOCK_K 32, 8 warps, 3 stages: 0 spill bytes, 66 KiB shared (the choice)
#   BLOCK_T 16, BLOCK_K 32, 4 warps, 2 or 3 stages: 32 or 40 spill bytes
#   BLOCK_T 32, BLOCK_K 32, 8 warps, 2 or 3 stages: 32 or 40 spill bytes (0 with 1 stage)
#   BLOCK_T 16, BLOCK_K 64, 8 warps, 3 stages: 0 spill bytes but 132 KiB shared
# Speed of each: unmeasured.
BLOCK_T = 16
BLOCK_K = 32
NUM_WARPS = 8
NUM_STAGES = 3


@triton.jit
def _gate_route_kernel(
    x_ptr,
    w_ptr,
    bias_ptr,
    weights_ptr,
    ids_ptr,
    num_tokens,
    num_experts,
    hidden,
    stride_x_t,
    stride_w_e,
    routed_scaling_factor,
    EXPERTS_PER_GROUP: tl.constexpr,
    N_GROUP: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    TOP_K: tl.constexpr,
    NORM_TOPK_PROB: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_G: tl.constexpr,
    BLOCK_TOPK: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    offs_t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, BLOCK_E)
    offs_d = tl.arange(0, BLOCK_D)
    t_ok = offs_t < num_tokens
    e_ok = offs_e < num_experts
    x_rows = x_ptr + offs_t[:, None] * stride_x_t
    w_cols = w_ptr + offs_e[None, :].to(tl.int64) * stride_w_e

    logits = tl.zeros((BLOCK_T, BLOCK_E), tl.float32)
    for d0 in range(0, hidden, BLOCK_D):
        d = d0 + offs_d
        d_ok = d < hidden
        x = tl.load(x_rows + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_cols + d[:, None], mask=d_ok[:, None] & e_ok[None, :], other=0.0)
        logits = tl.dot(x.to(tl.float32), w.to(tl.float32), logits, input_precision="ieee")

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
        BLOCK_TOPK,
    )


def launch_gate_route(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    weights_out: torch.Tensor,
    ids_out: torch.Tensor,
) -> None:
    """Route ``x [T, D]`` by ``gate_weight [E, D]`` (float32) into ``weights_out [T, top_k]``
    (float32) and ``ids_out [T, top_k]`` (int64), both contiguous; every element is written."""
    num_tokens, hidden = x.shape
    num_experts = gate_weight.shape[0]
    assert gate_weight.shape == (num_experts, hidden) and gate_weight.dtype == torch.float32
    check_routing_shape(num_experts, top_k, n_group, topk_group)
    assert weights_out.shape == ids_out.shape == (num_tokens, top_k)
    assert weights_out.dtype == torch.float32 and ids_out.dtype == torch.int64
    assert weights_out.is_contiguous() and ids_out.is_contiguous()
    if num_tokens == 0:
        return
    x = x if x.stride(-1) == 1 else x.contiguous()
    w = gate_weight if gate_weight.stride(-1) == 1 else gate_weight.contiguous()
    _gate_route_kernel[(triton.cdiv(num_tokens, BLOCK_T),)](
        x,
        w,
        correction_bias.contiguous(),
        weights_out,
        ids_out,
        num_tokens,
        num_experts,
        hidden,
        x.stride(0),
        w.stride(0),
        float(routed_scaling_factor),
        EXPERTS_PER_GROUP=num_experts // n_group,
        N_GROUP=n_group,
        TOPK_GROUP=topk_group,
        TOP_K=top_k,
        NORM_TOPK_PROB=bool(norm_topk_prob),
        BLOCK_T=BLOCK_T,
        BLOCK_E=max(16, triton.next_power_of_2(num_experts)),  # tl.dot's least N
        BLOCK_G=triton.next_power_of_2(n_group),
        BLOCK_TOPK=triton.next_power_of_2(top_k),
        BLOCK_D=BLOCK_K,
        num_warps=NUM_WARPS,
        num_stages=NUM_STAGES,
    )


def gate_route_triton(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Router GEMM and ``noaux_tc`` routing in one launch: ``(weights [T, top_k] float32, expert
    ids [T, top_k] int64)``, as ``grouped_topk(x.float() @ gate_weight.T, ...)``."""
    num_tokens = x.shape[0]
    weights = torch.empty((num_tokens, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((num_tokens, top_k), dtype=torch.int64, device=x.device)
    launch_gate_route(
        x,
        gate_weight,
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
