"""The routed experts as one grouped GEMM pair in Triton (the fused-MoE layout of vLLM/SGLang).

Each (token, slot) pair ``p = t * top_k + j`` is one row of work for expert ``topk_ids[t, j]``.
The rows are sorted by local expert and each expert's rows padded to a multiple of ``BLOCK_M``,
so every ``BLOCK_M`` block of sorted rows belongs to a single expert::

    topk_ids (T=3, top_k=2, first_expert=0, E_local=4)        pair p = t * top_k + j
      t0: [2, 0]    t1: [0, 3]    t2: [5, 0]        expert 5 is held elsewhere: pair 4 dropped

    BLOCK_M = 4; padding rows hold num_pairs (= 6): they read no token and write no pair
      sorted row       0  1  2  3 |  4  5  6  7 |  8  9 10 11 | 12 .. 15 | 16 .. 19
      sorted_pair_ids  1  2  5  6 |  0  6  6  6 |  3  6  6  6 |  6 .. 6 |  6 .. 6
      block_expert         0      |      2      |      3      |   -1    |   -1
                                                                 spare blocks: exit at once

    expert 1 has no pair and so no block. The buffers are sized for the worst case,
    num_pairs + min(num_pairs, E_local) * (BLOCK_M - 1) rows rounded up to BLOCK_M, so the
    bookkeeping stays on the device (no host sync, same shapes for every routing).

    gate/up kernel, program (block b, columns n .. n+BLOCK_N) of w_gate_up[e] [2I, D]:
      h[rows of b, n..]  = silu(x[t] @ gate[e][n..]^T) * (x[t] @ up[e][n..]^T)   up rows start at I
    down kernel, program (block b, columns d .. d+BLOCK_N) of w_down[e] [D, I]:
      y[p, d..] = topk_weights[p] * (h[rows of b] @ w_down[e][d..]^T)               real rows only
    sum kernel, program (token t, columns):
      out[t] = sum over j of y[t * top_k + j] where topk_ids[t, j] is local, else 0

Accumulation is float32; ``h``, ``y`` and the output are in ``x``'s dtype. Routing weights are
float32. A token none of whose experts is local gets a zero row. FP8 experts (``ExpertScales``)
take one of two modes: ``dequant``, each weight tile dequantised into ``x``'s dtype (these
kernels), or ``quant``, FP8 activations and FP8 x FP8 dots (``moe_experts_fp8_triton``, whose
``h`` is FP8 with group scales). FP4 experts (``ExpertScales.fmt`` ``fp4``) are dequantised per
tile in registers (``moe_experts_fp4_triton``).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from tandem.model.kernels.moe import ExpertScales
from tandem.model.kernels.moe_experts_fp4_triton import launch_fp4_gate_up_down
from tandem.model.kernels.moe_experts_fp8_triton import (
    QUANT_BLOCK_M,
    QUANT_NUM_WARPS,
    QuantizedRows,
    launch_quant_gate_up_down,
)


class ExpertDtypeMismatch(TypeError):
    def __init__(self, x_dtype: torch.dtype, w_gate_up_dtype: torch.dtype, w_down_dtype: torch.dtype) -> None:
        super().__init__(
            f"x is {x_dtype} but w_gate_up is {w_gate_up_dtype} and w_down is {w_down_dtype}: "
            "load the experts in the activation dtype, or as FP8 or FP4 bytes with their scales"
        )


@dataclass(frozen=True)
class ExpertBlocks:
    """Tile sizes: ``block_m`` sorted rows per program (shared by both GEMMs, it is the padding
    unit), and per GEMM the output columns and reduction step of one program."""

    block_m: int
    gate_up_block_n: int
    gate_up_block_k: int
    down_block_n: int
    down_block_k: int
    num_warps: int = 4


@dataclass(frozen=True)
class AlignedPairs:
    """``sorted_pair_ids [max_rows]`` int32 (padding = ``num_pairs``) and ``block_expert
    [max_rows / block_m]`` int32 (local expert of each block, -1 for a spare block)."""

    sorted_pair_ids: torch.Tensor
    block_expert: torch.Tensor
    num_pairs: int
    block_m: int


def _tile(dim: int, preferred: int) -> int:
    # tl.dot needs every tile dimension >= 16 on a GPU; masks cover the overhang
    return max(16, min(preferred, triton.next_power_of_2(dim)))


def pick_expert_blocks(
    num_pairs: int, num_local: int, hidden: int, inter: int, dtype: torch.dtype
) -> ExpertBlocks:
    # Few rows per expert (decode) waste most of a tall block on padding. num_pairs counts
    # pairs of every expert, so under expert parallelism this overestimates the local rows.
    rows_per_expert = num_pairs / max(num_local, 1)
    block_m = 16 if rows_per_expert <= 16 else 32 if rows_per_expert <= 64 else 64
    return ExpertBlocks(
        block_m=block_m,
        gate_up_block_n=_tile(inter, 64),
        gate_up_block_k=_tile(hidden, 64),
        down_block_n=_tile(hidden, 64),
        down_block_k=_tile(inter, 64),
        # float32 tiles (ieee dot, no tensor cores) spill on 4 warps at sm_90
        num_warps=8 if dtype == torch.float32 else 4,
    )


def padded_row_count(num_pairs: int, num_local: int, block_m: int) -> int:
    """Rows of the sorted layout in the worst case: every non-empty expert pads ``block_m - 1``."""
    return triton.cdiv(num_pairs + min(num_pairs, num_local) * (block_m - 1), block_m) * block_m


def align_pairs_to_blocks(
    topk_ids: torch.Tensor, first_expert: int, num_local: int, block_m: int
) -> AlignedPairs:
    """Sort the pairs by local expert (stable: token order within an expert) and pad each
    expert's rows to a multiple of ``block_m``; pairs of experts not held here are dropped."""
    device = topk_ids.device
    num_pairs = topk_ids.numel()
    local = topk_ids.reshape(-1).to(torch.int64) - first_expert
    # non-local pairs go to an extra bucket num_local, sorted last and then discarded
    bucket = torch.where((local >= 0) & (local < num_local), local, num_local)
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, bucket, torch.ones_like(bucket))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = padded[:num_local].cumsum(0)
    padded_start = torch.cat([padded_end - padded[:num_local], padded_end.new_zeros(1)])

    max_rows = padded_row_count(num_pairs, num_local, block_m)
    order = torch.argsort(bucket, stable=True)
    sorted_bucket = bucket[order]
    rank = torch.arange(num_pairs, device=device) - (counts.cumsum(0) - counts)[sorted_bucket]
    dest = torch.where(sorted_bucket < num_local, padded_start[sorted_bucket] + rank, max_rows)
    sorted_pair_ids = torch.full((max_rows + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_pair_ids.scatter_(0, dest, order.to(torch.int32))  # row max_rows collects dropped pairs

    block_start = torch.arange(0, max_rows, block_m, device=device)
    block_expert = torch.searchsorted(padded_end, block_start, right=True)
    block_expert = torch.where(block_expert < num_local, block_expert, -1).to(torch.int32)
    return AlignedPairs(sorted_pair_ids[:max_rows], block_expert, num_pairs, block_m)


@triton.jit
def _gate_up_silu_kernel(
    x_ptr,
    w_ptr,
    h_ptr,
    sorted_pair_ids_ptr,
    block_expert_ptr,
    num_pairs,
    hidden,
    inter,
    x_stride_t,
    x_stride_d,
    w_stride_e,
    w_stride_n,
    w_stride_d,
    h_stride_m,
    s_ptr,
    s_stride_e,
    s_stride_n,
    TOP_K: tl.constexpr,
    HAS_SCALE: tl.constexpr,
    SCALE_BO: tl.constexpr,
    SCALE_BI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    CLIP: tl.constexpr,
    limit,
):
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
    if expert < 0:
        return
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(sorted_pair_ids_ptr + offs_m).to(tl.int64)
    row_ok = pair < num_pairs
    token = pair // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_k = tl.arange(0, BLOCK_K)

    x_ptrs = x_ptr + token[:, None] * x_stride_t + offs_k[None, :] * x_stride_d
    gate_ptrs = w_ptr + expert * w_stride_e + offs_n[None, :] * w_stride_n + offs_k[:, None] * w_stride_d
    up_ptrs = gate_ptrs + inter * w_stride_n
    if HAS_SCALE:  # FP8 experts: gate's scale rows, then up's from row ceil(I / bo)
        gate_s_ptrs = s_ptr + expert * s_stride_e + (offs_n // SCALE_BO) * s_stride_n
        up_s_ptrs = gate_s_ptrs + tl.cdiv(inter, SCALE_BO) * s_stride_n
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = offs_k < hidden - k0
        xa = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(gate_ptrs, mask=w_mask, other=0.0)
        wu = tl.load(up_ptrs, mask=w_mask, other=0.0)
        if HAS_SCALE:  # dequantise the tile into the activation dtype
            sg = tl.load(gate_s_ptrs + k0 // SCALE_BI, mask=n_ok, other=0.0)
            su = tl.load(up_s_ptrs + k0 // SCALE_BI, mask=n_ok, other=0.0)
            wg = (wg.to(tl.float32) * sg[None, :]).to(xa.dtype)
            wu = (wu.to(tl.float32) * su[None, :]).to(xa.dtype)
        if UPCAST_DOT:
            xa, wg, wu = xa.to(tl.float32), wg.to(tl.float32), wu.to(tl.float32)
        gate = tl.dot(xa, wg, gate, input_precision=DOT_PRECISION)
        up = tl.dot(xa, wu, up, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K * x_stride_d
        gate_ptrs += BLOCK_K * w_stride_d
        up_ptrs += BLOCK_K * w_stride_d

    if CLIP:  # DeepSeek-V4: the gate clipped from above, the up on both sides
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate * tl.sigmoid(gate) * up
    h_ptrs = h_ptr + offs_m[:, None] * h_stride_m + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    w_ptr,
    y_ptr,
    topk_weights_ptr,
    sorted_pair_ids_ptr,
    block_expert_ptr,
    num_pairs,
    hidden,
    inter,
    h_stride_m,
    w_stride_e,
    w_stride_n,
    w_stride_k,
    y_stride_p,
    s_ptr,
    s_stride_e,
    s_stride_n,
    HAS_SCALE: tl.constexpr,
    SCALE_BO: tl.constexpr,
    SCALE_BI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
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
    offs_k = tl.arange(0, BLOCK_K)

    h_ptrs = h_ptr + offs_m[:, None] * h_stride_m + offs_k[None, :]
    w_ptrs = w_ptr + expert * w_stride_e + offs_n[None, :] * w_stride_n + offs_k[:, None] * w_stride_k
    if HAS_SCALE:
        s_ptrs = s_ptr + expert * s_stride_e + (offs_n // SCALE_BO) * s_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_ok = offs_k < inter - k0
        ha = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
        wb = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if HAS_SCALE:
            sb = tl.load(s_ptrs + k0 // SCALE_BI, mask=n_ok, other=0.0)
            wb = (wb.to(tl.float32) * sb[None, :]).to(ha.dtype)
        if UPCAST_DOT:
            ha, wb = ha.to(tl.float32), wb.to(tl.float32)
        acc = tl.dot(ha, wb, acc, input_precision=DOT_PRECISION)
        h_ptrs += BLOCK_K
        w_ptrs += BLOCK_K * w_stride_k

    weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)
    y = acc * weight[:, None]
    y_ptrs = y_ptr + pair[:, None] * y_stride_p + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _sum_local_pairs_kernel(
    y_ptr,
    topk_ids_ptr,
    out_ptr,
    hidden,
    first_expert,
    num_local,
    y_stride_p,
    out_stride_t,
    TOP_K: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    offs_d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = offs_d < hidden
    acc = tl.zeros((BLOCK_D,), tl.float32)
    for j in tl.static_range(TOP_K):
        pair = token * TOP_K + j
        # a vector, not a scalar: Triton's interpreter mis-types a scalar-and-vector mask
        local = tl.broadcast_to(tl.load(topk_ids_ptr + pair) - first_expert, (BLOCK_D,))
        is_local = (local >= 0) & (local < num_local)
        y = tl.load(y_ptr + pair * y_stride_p + offs_d, mask=d_ok & is_local, other=0.0)
        acc += y.to(tl.float32)
    tl.store(out_ptr + token * out_stride_t + offs_d, acc.to(out_ptr.dtype.element_ty), mask=d_ok)


def _launch_gate_up_down(
    x: torch.Tensor,
    weights: torch.Tensor,
    aligned: AlignedPairs,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    scales: ExpertScales | None,
    blocks: ExpertBlocks,
    h: torch.Tensor,
    y: torch.Tensor,
    top_k: int,
    swiglu_limit: float | None = None,
) -> None:
    """The gate/up and down kernels in ``x``'s dtype (FP8 experts dequantised per tile)."""
    hidden = x.shape[1]
    inter = w_gate_up.shape[1] // 2
    assert h.shape == (aligned.sorted_pair_ids.numel(), inter) and h.stride(-1) == 1
    precision = "ieee" if x.dtype == torch.float32 else "tf32"  # no TF32 rounding of float32 inputs
    # Triton's interpreter multiplies bfloat16 tiles as their raw 16-bit patterns; a GPU never upcasts
    upcast = x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    num_blocks = aligned.block_expert.numel()
    # FP8 experts: tiles are dequantised into x's dtype, one scale column per reduction step
    s13 = scales.gate_up if scales is not None else w_gate_up
    s2 = scales.down if scales is not None else w_down
    bo, bi = scales.block if scales is not None else (1, 1)
    if scales is not None:
        assert bi % blocks.gate_up_block_k == 0 and bi % blocks.down_block_k == 0

    _gate_up_silu_kernel[(num_blocks, triton.cdiv(inter, blocks.gate_up_block_n))](
        x,
        w_gate_up,
        h,
        aligned.sorted_pair_ids,
        aligned.block_expert,
        aligned.num_pairs,
        hidden,
        inter,
        x.stride(0),
        x.stride(1),
        w_gate_up.stride(0),
        w_gate_up.stride(1),
        w_gate_up.stride(2),
        h.stride(0),
        s13,
        s13.stride(0),
        s13.stride(1),
        TOP_K=top_k,
        HAS_SCALE=scales is not None,
        SCALE_BO=bo,
        SCALE_BI=bi,
        DOT_PRECISION=precision,
        UPCAST_DOT=upcast,
        BLOCK_M=blocks.block_m,
        BLOCK_N=blocks.gate_up_block_n,
        BLOCK_K=blocks.gate_up_block_k,
        CLIP=swiglu_limit is not None,
        limit=float(swiglu_limit or 0.0),
        num_warps=blocks.num_warps,
        num_stages=3,
    )
    _down_kernel[(num_blocks, triton.cdiv(hidden, blocks.down_block_n))](
        h,
        w_down,
        y,
        weights,
        aligned.sorted_pair_ids,
        aligned.block_expert,
        aligned.num_pairs,
        hidden,
        inter,
        h.stride(0),
        w_down.stride(0),
        w_down.stride(1),
        w_down.stride(2),
        y.stride(0),
        s2,
        s2.stride(0),
        s2.stride(1),
        HAS_SCALE=scales is not None,
        SCALE_BO=bo,
        SCALE_BI=bi,
        DOT_PRECISION=precision,
        UPCAST_DOT=upcast,
        BLOCK_M=blocks.block_m,
        BLOCK_N=blocks.down_block_n,
        BLOCK_K=blocks.down_block_k,
        num_warps=blocks.num_warps,
        num_stages=3,
    )


def launch_fused_experts(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    first_expert: int,
    blocks: ExpertBlocks,
    h: torch.Tensor | QuantizedRows,
    y: torch.Tensor,
    out: torch.Tensor,
    scales: ExpertScales | None = None,
    swiglu_limit: float | None = None,
) -> None:
    """Run the three kernels into caller-owned buffers: ``h [max_rows, I]`` (every row of a used
    block is written; ``QuantizedRows`` in ``quant`` mode), ``y [T * top_k, D]`` (rows of local
    pairs are written) and ``out [T, D]`` (every element is written). ``max_rows`` is
    ``padded_row_count``."""
    num_tokens, hidden = x.shape
    top_k = topk_ids.shape[1]
    num_local = w_gate_up.shape[0]
    if num_tokens == 0:
        return
    aligned = align_pairs_to_blocks(topk_ids, first_expert, num_local, blocks.block_m)
    assert y.shape == (num_tokens * top_k, hidden) and y.stride(-1) == 1
    assert out.shape == (num_tokens, hidden) and out.stride(-1) == 1
    weights = topk_weights.to(torch.float32).contiguous()
    if scales is not None and scales.fmt == "fp4":
        assert isinstance(h, torch.Tensor)
        launch_fp4_gate_up_down(
            x, weights, aligned.sorted_pair_ids, aligned.block_expert, w_gate_up, w_down,
            scales.gate_up, scales.down, h, y, top_k, blocks.block_m,
            (blocks.gate_up_block_n, blocks.down_block_n), blocks.num_warps, swiglu_limit,
        )  # fmt: skip
    elif scales is not None and scales.mode == "quant":
        assert isinstance(h, QuantizedRows)
        ids, block_expert = aligned.sorted_pair_ids, aligned.block_expert
        launch_quant_gate_up_down(
            x, weights, ids, block_expert, w_gate_up, w_down, scales, h, y, top_k, blocks.down_block_n
        )
    else:
        assert isinstance(h, torch.Tensor)
        _launch_gate_up_down(
            x, weights, aligned, w_gate_up, w_down, scales, blocks, h, y, top_k, swiglu_limit
        )
    block_d = min(1024, triton.next_power_of_2(hidden))
    _sum_local_pairs_kernel[(num_tokens, triton.cdiv(hidden, block_d))](
        y,
        topk_ids.contiguous(),
        out,
        hidden,
        first_expert,
        num_local,
        y.stride(0),
        out.stride(0),
        TOP_K=top_k,
        BLOCK_D=block_d,
        num_warps=4,
    )


def fused_experts_triton(
    x: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    first_expert: int,
    scales: ExpertScales | None = None,
    swiglu_limit: float | None = None,
) -> torch.Tensor:
    """Sum over each token's local experts of ``weight * down(silu(gate(x)) * up(x))`` -> ``[T, D]``.

    The experts are in ``x``'s dtype, or FP8 with their ``scales`` (in ``scales.mode``); with
    ``swiglu_limit`` the gate and up are clipped first (``moe.clip_gate_up``; dequant mode)."""
    if scales is None and not x.dtype == w_gate_up.dtype == w_down.dtype:
        raise ExpertDtypeMismatch(x.dtype, w_gate_up.dtype, w_down.dtype)
    stored = torch.uint8 if scales is not None and scales.fmt == "fp4" else torch.float8_e4m3fn
    if scales is not None and not w_gate_up.dtype == w_down.dtype == stored:
        raise ExpertDtypeMismatch(x.dtype, w_gate_up.dtype, w_down.dtype)
    num_tokens, hidden = x.shape
    num_local, two_inter, _ = w_gate_up.shape
    num_pairs = topk_ids.numel()
    blocks = pick_expert_blocks(num_pairs, num_local, hidden, two_inter // 2, x.dtype)
    quant = scales is not None and scales.mode == "quant"
    if quant and swiglu_limit is not None:
        raise ValueError("clipped experts (swiglu_limit) run in dequant mode, not quant")
    if quant:
        blocks = replace(blocks, block_m=QUANT_BLOCK_M, num_warps=QUANT_NUM_WARPS)
    elif scales is not None and scales.fmt == "fp8":  # a step must not straddle two scale columns
        bi = scales.block[1]
        blocks = replace(
            blocks,
            gate_up_block_k=math.gcd(blocks.gate_up_block_k, bi),
            down_block_k=math.gcd(blocks.down_block_k, bi),
        )
    max_rows = padded_row_count(num_pairs, num_local, blocks.block_m)
    inter = two_inter // 2
    h: torch.Tensor | QuantizedRows
    if scales is not None and quant:
        h = QuantizedRows.empty(max_rows, inter, scales.block[1], x.device)
    else:
        h = torch.empty((max_rows, inter), dtype=x.dtype, device=x.device)
    y = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    out = torch.empty((num_tokens, hidden), dtype=x.dtype, device=x.device)
    launch_fused_experts(
        x, topk_weights, topk_ids, w_gate_up, w_down, first_expert, blocks, h, y, out, scales, swiglu_limit
    )
    return out
