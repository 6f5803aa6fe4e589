"""The routed experts' GEMM pair with FP8 activations (``TANDEM_FP8_ACTIVATIONS=quant``).

The layout of rows and blocks is ``moe_experts_triton``'s. Activations are quantised per
``1 x bi`` group (``bi`` the scale block's width) and both operands of every ``tl.dot`` are
FP8, each partial product scaled in float32 by the activation group's and the weight block's
scales, as DeepSeek-V3's inference and SGLang's/vLLM's block-FP8 fused MoE do::

    x [T, D] --quantize_activations--> xq [T, D] fp8, xs [T, ceil(D/bi)]        once per token

    gate/up kernel, program (block b, group g) -> h's columns g*bi .. g*bi+bi-1 of I
      for each step kb over D (bi wide):
        gate += (xq[t, kb] @ gate[e][cols, kb]^T) * xs[t, kb] * s_gate[e][col // bo, kb]
        up   += (xq[t, kb] @ up[e][cols, kb]^T)   * xs[t, kb] * s_up[e][col // bo, kb]
      epilogue: h = silu(gate) * up (float32), quantised here, the program holding its whole
      group: hq [rows of b, cols] fp8, hs [rows of b, g]

    down kernel, program (block b, columns d .. d+BLOCK_N of D):
      y[p, d..] = topk_weights[p] * sum over kb of (hq[rows, kb] @ down[e][d.., kb]^T) * hs * s_down

A step is one scale group, ``bi`` wide, on a tile of ``next_power_of_2(bi)`` columns (masked
past ``bi``), so blocks that are no power of two (tiny checkpoints) still take one scale per step.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tandem.model.kernels.fp8 import FP8_DTYPE, FP8_MAX
from tandem.model.kernels.fp8_gemm_triton import quantize_activations, quantize_group_rows
from tandem.model.kernels.moe import ExpertScales


@dataclass(frozen=True)
class QuantizedRows:
    """The intermediate ``h`` as the down GEMM reads it: ``q [max_rows, I]`` float8 e4m3 and
    ``scale [max_rows, ceil(I / bi)]`` float32, ``h ~= q * scale`` per ``1 x bi`` group."""

    q: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def empty(rows: int, inter: int, group: int, device: torch.device) -> QuantizedRows:
        q = torch.empty((rows, inter), dtype=FP8_DTYPE, device=device)
        scale = torch.empty((rows, triton.cdiv(inter, group)), dtype=torch.float32, device=device)
        return QuantizedRows(q, scale)


# 64 rows: Hopper's smallest FP8 wgmma (with fewer rows Triton multiplies FP8 as float16 on
# mma.sync), on 8 warps (two float32 accumulators of 64 x 128 spill on 4 at sm_90). Decode pads
# more rows than with 16; the weights' bytes dominate its time there.
QUANT_BLOCK_M = 64
QUANT_NUM_WARPS = 8


def group_tile(group: int) -> int:
    """Columns of the tile that holds one ``group``: a power of two, at least 16 for ``tl.dot``."""
    return max(16, triton.next_power_of_2(group))


@triton.jit
def _gate_up_silu_quant_kernel(
    xq_ptr,
    xs_ptr,
    w_ptr,
    s_ptr,
    hq_ptr,
    hs_ptr,
    sorted_pair_ids_ptr,
    block_expert_ptr,
    num_pairs,
    hidden,
    inter,
    xq_stride_t,
    xs_stride_t,
    w_stride_e,
    w_stride_n,
    s_stride_e,
    s_stride_n,
    hq_stride_m,
    hs_stride_m,
    TOP_K: tl.constexpr,
    SCALE_BO: tl.constexpr,
    SCALE_BI: tl.constexpr,
    FP8_MAX_: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_m).to(tl.int64)
    row_ok = pair < num_pairs
    token = pair // TOP_K
    group = tl.program_id(1)
    lane = tl.arange(0, BLOCK_G)
    offs_n = group * SCALE_BI + lane  # this program's group of h's columns
    n_ok = (lane < SCALE_BI) & (offs_n < inter)

    x_ptrs = xq_ptr + token[:, None] * xq_stride_t + lane[None, :]
    xs_ptrs = xs_ptr + token * xs_stride_t
    gate_ptrs = w_ptr + expert * w_stride_e + offs_n[None, :] * w_stride_n + lane[:, None]
    up_ptrs = gate_ptrs + inter * w_stride_n
    # gate's scale rows, then up's from row ceil(I / bo)
    gate_s_ptrs = s_ptr + expert * s_stride_e + (offs_n // SCALE_BO) * s_stride_n
    up_s_ptrs = gate_s_ptrs + tl.cdiv(inter, SCALE_BO) * s_stride_n
    gate = tl.zeros((BLOCK_M, BLOCK_G), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_G), tl.float32)
    for kb in range(0, tl.cdiv(hidden, SCALE_BI)):
        k_ok = (lane < SCALE_BI) & (lane < hidden - kb * SCALE_BI)
        xa = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        x_scale = tl.load(xs_ptrs + kb, mask=row_ok, other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        wu = tl.load(up_ptrs, mask=w_mask, other=0.0)
        sg = tl.load(gate_s_ptrs + kb, mask=n_ok, other=0.0)
        su = tl.load(up_s_ptrs + kb, mask=n_ok, other=0.0)
        if UPCAST:  # Triton's interpreter multiplies fp8 tiles as raw bit patterns
            part_g = tl.dot(xa.to(tl.float32), wg.to(tl.float32), input_precision="ieee")
            part_u = tl.dot(xa.to(tl.float32), wu.to(tl.float32), input_precision="ieee")
        else:
            part_g = tl.dot(xa, wg)
            part_u = tl.dot(xa, wu)
        gate += part_g * x_scale[:, None] * sg[None, :]
        up += part_u * x_scale[:, None] * su[None, :]
        x_ptrs += SCALE_BI
        gate_ptrs += SCALE_BI
        up_ptrs += SCALE_BI

    # columns past the group and padding rows are 0 here, and so add nothing to a group's amax
    h = gate * tl.sigmoid(gate) * up
    q, scale = quantize_group_rows(h, FP8_MAX_, ROUND_FIRST)
    hq_ptrs = hq_ptr + offs_m[:, None] * hq_stride_m + offs_n[None, :]
    tl.store(hq_ptrs, q.to(hq_ptr.dtype.element_ty), mask=n_ok[None, :])
    tl.store(hs_ptr + offs_m * hs_stride_m + group, scale)


@triton.jit
def _down_quant_kernel(
    hq_ptr,
    hs_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    topk_weights_ptr,
    sorted_pair_ids_ptr,
    block_expert_ptr,
    num_pairs,
    hidden,
    inter,
    hq_stride_m,
    hs_stride_m,
    w_stride_e,
    w_stride_n,
    s_stride_e,
    s_stride_n,
    y_stride_p,
    SCALE_BO: tl.constexpr,
    SCALE_BI: tl.constexpr,
    UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_m).to(tl.int64)
    row_ok = pair < num_pairs
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    lane = tl.arange(0, BLOCK_G)

    h_ptrs = hq_ptr + offs_m[:, None] * hq_stride_m + lane[None, :]
    hs_ptrs = hs_ptr + offs_m * hs_stride_m
    w_ptrs = w_ptr + expert * w_stride_e + offs_n[None, :] * w_stride_n + lane[:, None]
    s_ptrs = s_ptr + expert * s_stride_e + (offs_n // SCALE_BO) * s_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(0, tl.cdiv(inter, SCALE_BI)):
        k_ok = (lane < SCALE_BI) & (lane < inter - kb * SCALE_BI)
        ha = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
        h_scale = tl.load(hs_ptrs + kb)  # every row of a used block has its scales
        wb = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        sb = tl.load(s_ptrs + kb, mask=n_ok, other=0.0)
        if UPCAST:
            part = tl.dot(ha.to(tl.float32), wb.to(tl.float32), input_precision="ieee")
        else:
            part = tl.dot(ha, wb)
        acc += part * h_scale[:, None] * sb[None, :]
        h_ptrs += SCALE_BI
        w_ptrs += SCALE_BI

    weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)
    y = acc * weight[:, None]
    y_ptrs = y_ptr + pair[:, None] * y_stride_p + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def launch_quant_gate_up_down(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    sorted_pair_ids: torch.Tensor,
    block_expert: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    scales: ExpertScales,
    h: QuantizedRows,
    y: torch.Tensor,
    top_k: int,
    down_block_n: int,
) -> None:
    """Quantise ``x``, then the two kernels over ``QUANT_BLOCK_M``-row blocks (``sorted_pair_ids``
    and ``block_expert`` as ``moe_experts_triton.align_pairs_to_blocks`` lays them out): ``h`` gets
    every row of a used block, ``y`` the rows of local pairs. The other tiles are a group wide."""
    hidden = x.shape[1]
    inter = w_gate_up.shape[1] // 2
    bo, bi = scales.block
    assert h.q.shape == (sorted_pair_ids.numel(), inter) and h.q.stride(-1) == 1
    assert h.scale.shape == (h.q.shape[0], triton.cdiv(inter, bi))
    assert w_gate_up.stride(-1) == 1 and w_down.stride(-1) == 1
    assert sorted_pair_ids.numel() == block_expert.numel() * QUANT_BLOCK_M
    num_pairs = x.shape[0] * top_k
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    xq, xs = quantize_activations(x, bi)
    num_blocks = block_expert.numel()
    s13, s2 = scales.gate_up, scales.down
    _gate_up_silu_quant_kernel[(num_blocks, triton.cdiv(inter, bi))](
        xq,
        xs,
        w_gate_up,
        s13,
        h.q,
        h.scale,
        sorted_pair_ids,
        block_expert,
        num_pairs,
        hidden,
        inter,
        xq.stride(0),
        xs.stride(0),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        s13.stride(0),
        s13.stride(1),
        h.q.stride(0),
        h.scale.stride(0),
        TOP_K=top_k,
        SCALE_BO=bo,
        SCALE_BI=bi,
        FP8_MAX_=FP8_MAX,
        ROUND_FIRST=interpreted,
        UPCAST=interpreted,
        BLOCK_M=QUANT_BLOCK_M,
        BLOCK_G=group_tile(bi),
        num_warps=QUANT_NUM_WARPS,
        num_stages=3,
    )
    _down_quant_kernel[(num_blocks, triton.cdiv(hidden, down_block_n))](
        h.q,
        h.scale,
        w_down,
        s2,
        y,
        topk_weights,
        sorted_pair_ids,
        block_expert,
        num_pairs,
        hidden,
        inter,
        h.q.stride(0),
        h.scale.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        s2.stride(0),
        s2.stride(1),
        y.stride(0),
        SCALE_BO=bo,
        SCALE_BI=bi,
        UPCAST=interpreted,
        BLOCK_M=QUANT_BLOCK_M,
        BLOCK_N=down_block_n,
        BLOCK_G=group_tile(bi),
        num_warps=QUANT_NUM_WARPS,
        num_stages=3,
    )
