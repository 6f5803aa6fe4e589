"""The routed experts' GEMM pair over FP4 weights (``kernels/fp4.py``), dequantised in registers.

The rows, blocks and buffers are ``moe_experts_triton``'s (sorted pairs padded per expert to
``BLOCK_M``, ``h`` in ``x``'s dtype, float32 accumulation). Only the weight tiles differ: a
reduction step of ``BLOCK_K`` inputs reads ``BLOCK_K / 2`` bytes a column and their scale bytes
(one per 32 inputs), and splits each byte into its two e2m1 nibbles. The low nibbles are the
even inputs and the high ones the odd inputs, so the step is two dots, one over ``x``'s even
columns and one over its odd columns; no interleave is ever built::

    gate/up kernel, program (block b, columns n .. n+BLOCK_N of I), step k0 over D:
      bytes  w[e][n.., k0/2 .. k0/2 + BLOCK_K/2]      [BLOCK_K/2, BLOCK_N] uint8
      scale  2 ** (s[e][n.., (k0 + 2j) // 32] - 127)  per byte j (both its inputs share a group)
      gate  += x[t, k0 + 2j] @ (e2m1(lo) * scale)  +  x[t, k0 + 2j + 1] @ (e2m1(hi) * scale)

Each tile is dequantised into ``x``'s dtype, which holds every e2m1 value times a power of two
exactly: the result is the dequantised experts' up to summation order. The weights stay in
memory as bytes, half a byte a weight; where a GPU has native FP4 dots (Blackwell's MXFP4) a
kernel on those would read the same bytes."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tandem.model.kernels.fp4 import FP4_GROUP


@triton.jit
def _e2m1(nibble):
    """Each e2m1 nibble's value, float32: sign bit 3, exponent bits 1-2, mantissa bit 0."""
    nibble = nibble.to(tl.int32)
    magnitude = nibble & 7
    exponent = magnitude >> 1
    mantissa = (magnitude & 1).to(tl.float32)
    normal = (1.0 + 0.5 * mantissa) * tl.exp2((exponent - 1).to(tl.float32))
    value = tl.where(exponent == 0, 0.5 * mantissa, normal)
    return tl.where(nibble >= 8, -value, value)


@triton.jit
def _fp4_tile(w_ptrs, s_ptrs, mask, dtype: tl.constexpr):
    """A tile of bytes -> its low (even inputs) and high (odd inputs) halves in ``dtype``."""
    packed = tl.load(w_ptrs, mask=mask, other=0)
    scale = tl.exp2(tl.load(s_ptrs, mask=mask, other=127).to(tl.float32) - 127.0)
    low = (_e2m1(packed & 15) * scale).to(dtype)
    high = (_e2m1(packed >> 4) * scale).to(dtype)
    return low, high


@triton.jit
def _fp4_gate_up_silu_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    h_ptr,
    sorted_pair_ids_ptr,
    block_expert_ptr,
    num_pairs,
    hidden,
    inter,
    x_stride_t,
    w_stride_e,
    w_stride_n,
    s_stride_e,
    s_stride_n,
    h_stride_m,
    limit,
    TOP_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    CLIP: tl.constexpr,
    GROUP: tl.constexpr,
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
    token = pair // TOP_K
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter
    offs_b = tl.arange(0, BLOCK_K // 2)  # bytes of a step: inputs 2j and 2j + 1

    x_even = x_ptr + token[:, None] * x_stride_t + 2 * offs_b[None, :]
    gate_w = w_ptr + expert * w_stride_e + offs_n[None, :] * w_stride_n + offs_b[:, None]
    gate_s = s_ptr + expert * s_stride_e + offs_n[None, :] * s_stride_n + (2 * offs_b[:, None]) // GROUP
    up_w = gate_w + inter * w_stride_n
    up_s = gate_s + inter * s_stride_n
    gate = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        b_ok = offs_b < (hidden - k0) // 2
        x_mask = row_ok[:, None] & b_ok[None, :]
        xe = tl.load(x_even + k0, mask=x_mask, other=0.0)
        xo = tl.load(x_even + k0 + 1, mask=x_mask, other=0.0)
        w_mask = b_ok[:, None] & n_ok[None, :]
        gate_lo, gate_hi = _fp4_tile(gate_w + k0 // 2, gate_s + k0 // GROUP, w_mask, xe.dtype)
        up_lo, up_hi = _fp4_tile(up_w + k0 // 2, up_s + k0 // GROUP, w_mask, xe.dtype)
        if UPCAST_DOT:
            xe, xo = xe.to(tl.float32), xo.to(tl.float32)
            gate_lo, gate_hi = gate_lo.to(tl.float32), gate_hi.to(tl.float32)
            up_lo, up_hi = up_lo.to(tl.float32), up_hi.to(tl.float32)
        gate = tl.dot(xe, gate_lo, gate, input_precision=DOT_PRECISION)
        gate = tl.dot(xo, gate_hi, gate, input_precision=DOT_PRECISION)
        up = tl.dot(xe, up_lo, up, input_precision=DOT_PRECISION)
        up = tl.dot(xo, up_hi, up, input_precision=DOT_PRECISION)

    if CLIP:  # DeepSeek-V4: the gate clipped from above, the up on both sides
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate * tl.sigmoid(gate) * up
    h_ptrs = h_ptr + offs_m[:, None] * h_stride_m + offs_n[None, :]
    tl.store(h_ptrs, h.to(h_ptr.dtype.element_ty), mask=n_ok[None, :])


@triton.jit
def _fp4_down_kernel(
    h_ptr,
    w_ptr,
    s_ptr,
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
    s_stride_e,
    s_stride_n,
    y_stride_p,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    GROUP: tl.constexpr,
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
    offs_b = tl.arange(0, BLOCK_K // 2)

    h_even = h_ptr + offs_m[:, None] * h_stride_m + 2 * offs_b[None, :]
    w_ptrs = w_ptr + expert * w_stride_e + offs_n[None, :] * w_stride_n + offs_b[:, None]
    s_ptrs = s_ptr + expert * s_stride_e + offs_n[None, :] * s_stride_n + (2 * offs_b[:, None]) // GROUP
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        b_ok = offs_b < (inter - k0) // 2
        he = tl.load(h_even + k0, mask=b_ok[None, :], other=0.0)
        ho = tl.load(h_even + k0 + 1, mask=b_ok[None, :], other=0.0)
        lo, hi = _fp4_tile(w_ptrs + k0 // 2, s_ptrs + k0 // GROUP, b_ok[:, None] & n_ok[None, :], he.dtype)
        if UPCAST_DOT:
            he, ho, lo, hi = he.to(tl.float32), ho.to(tl.float32), lo.to(tl.float32), hi.to(tl.float32)
        acc = tl.dot(he, lo, acc, input_precision=DOT_PRECISION)
        acc = tl.dot(ho, hi, acc, input_precision=DOT_PRECISION)

    weight = tl.load(topk_weights_ptr + pair, mask=row_ok, other=0.0)
    y = acc * weight[:, None]
    y_ptrs = y_ptr + pair[:, None] * y_stride_p + offs_n[None, :]
    tl.store(y_ptrs, y.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


def fp4_step(dim: int, preferred: int) -> int:
    """Inputs of a reduction step: a multiple of the scale group, its bytes at least 16 wide
    (``tl.dot``)."""
    return max(FP4_GROUP, min(preferred, triton.next_power_of_2(dim)))


def gate_up_step(hidden: int, block_m: int) -> int:
    """The gate/up kernel's step: 128 inputs, 64 on tall blocks (its four weight tiles and two
    accumulators would spill registers at sm_90 otherwise: ``test_moe_experts_fp4``)."""
    return fp4_step(hidden, 128 if block_m < 64 else 64)


def launch_fp4_gate_up_down(
    x: torch.Tensor,
    weights: torch.Tensor,
    sorted_pair_ids: torch.Tensor,
    block_expert: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    s_gate_up: torch.Tensor,
    s_down: torch.Tensor,
    h: torch.Tensor,
    y: torch.Tensor,
    top_k: int,
    block_m: int,
    block_n: tuple[int, int],
    num_warps: int,
    swiglu_limit: float | None = None,
) -> None:
    """The gate/up and down kernels over FP4 experts (bytes and scale bytes, ``uint8``), in
    ``x``'s dtype; ``block_n``: the two GEMMs' output columns a program."""
    hidden = x.shape[1]
    inter = w_gate_up.shape[1] // 2
    if hidden % FP4_GROUP or inter % FP4_GROUP:
        raise ValueError(f"FP4 experts need D ({hidden}) and I ({inter}) multiples of {FP4_GROUP}")
    assert x.stride(1) == 1 and h.stride(1) == 1 and w_gate_up.stride(2) == 1 and w_down.stride(2) == 1
    assert s_gate_up.stride(2) == 1 and s_down.stride(2) == 1
    num_pairs = weights.numel()
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    upcast = x.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    num_blocks = block_expert.numel()
    _fp4_gate_up_silu_kernel[(num_blocks, triton.cdiv(inter, block_n[0]))](
        x, w_gate_up, s_gate_up, h, sorted_pair_ids, block_expert, num_pairs, hidden, inter,
        x.stride(0), w_gate_up.stride(0), w_gate_up.stride(1), s_gate_up.stride(0), s_gate_up.stride(1),
        h.stride(0), float(swiglu_limit or 0.0),
        TOP_K=top_k, DOT_PRECISION=precision, UPCAST_DOT=upcast, CLIP=swiglu_limit is not None,
        GROUP=FP4_GROUP, BLOCK_M=block_m, BLOCK_N=block_n[0], BLOCK_K=gate_up_step(hidden, block_m),
        num_warps=num_warps, num_stages=3,
    )  # fmt: skip
    _fp4_down_kernel[(num_blocks, triton.cdiv(hidden, block_n[1]))](
        h, w_down, s_down, y, weights, sorted_pair_ids, block_expert, num_pairs, hidden, inter,
        h.stride(0), w_down.stride(0), w_down.stride(1), s_down.stride(0), s_down.stride(1), y.stride(0),
        DOT_PRECISION=precision, UPCAST_DOT=upcast, GROUP=FP4_GROUP,
        BLOCK_M=block_m, BLOCK_N=block_n[1], BLOCK_K=fp4_step(inter, 128),
        num_warps=num_warps, num_stages=3,
    )  # fmt: skip
