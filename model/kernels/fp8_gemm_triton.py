"""The block-scaled FP8 GEMM in Triton: ``c [M, N] = a [M, K] @ dequant(w [N, K])^T``.

One program computes a ``BLOCK_M x BLOCK_N`` tile of ``c``, stepping over ``K`` by ``BLOCK_K``
(a divisor of the scale block's ``bi``, so every step lies in one scale column)::

    w tile [BLOCK_K, BLOCK_N] fp8      w_scale[n // bo, k // bi]  one per output column
    dequant: acc += a_tile @ (w_tile * w_scale).to(a.dtype)
    quant:   acc += (a_fp8 @ w_fp8) * a_scale[m, k // bi] * w_scale[n // bo, k // bi]

In ``quant`` mode ``a`` arrives quantised per ``1 x bi`` group (:func:`quantize_activations`, a
kernel of its own). A GPU multiplies FP8 tiles natively; Triton's interpreter upcasts them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from tandem.model.kernels.fp8 import FP8_DTYPE, FP8_MAX, Fp8Mode
from tandem.model.kernels.tuning import fp8_gemm_tiles


@triton.jit
def _round_to_e4m3(v):
    """``v`` (|v| <= 448) rounded to the nearest float8 e4m3 value, ties to even, in float32.

    Triton's interpreter casts to fp8 without carrying a rounding into the exponent (125.0
    becomes 64.0, not 128.0), so under it values are rounded here and the cast is exact."""
    mag = tl.abs(v)
    exponent = tl.maximum(tl.floor(tl.log2(tl.maximum(mag, 1e-30))), -6.0)  # subnormals: 2^-9 steps
    step = tl.exp2(exponent - 3.0)
    y = mag / step
    r = tl.floor(y + 0.5)
    r = tl.where((r - y == 0.5) & (r % 2.0 == 1.0), r - 1.0, r)
    return tl.where(v < 0, -r * step, r * step)


@triton.jit
def quantize_group_rows(x, FP8_MAX_: tl.constexpr, ROUND_FIRST: tl.constexpr):
    """Each row of a float32 tile ``x [R, G]``, one ``1 x bi`` group a row (columns past the
    group zero), to ``(q [R, G], scale [R])`` with ``x ~= q * scale``: ``q`` holds e4m3 values in
    float32, for the caller's cast. ``ROUND_FIRST`` under Triton's interpreter (:func:`_round_to_e4m3`)."""
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax / FP8_MAX_, 1.0)
    q = tl.clamp(x / scale[:, None], -FP8_MAX_, FP8_MAX_)
    if ROUND_FIRST:
        q = _round_to_e4m3(q)
    return q, scale


@triton.jit
def _quantize_groups_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    cols,
    x_stride,
    q_stride,
    s_stride,
    FP8_MAX_: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    ROUND_FIRST: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    lane = tl.arange(0, GROUP_PAD)
    offs = group * GROUP + lane
    ok = (lane < GROUP) & (offs < cols)
    x = tl.load(x_ptr + row * x_stride + offs, mask=ok, other=0.0).to(tl.float32)
    q, scale = quantize_group_rows(x[None, :], FP8_MAX_, ROUND_FIRST)
    tl.store(q_ptr + row * q_stride + offs[None, :], q.to(q_ptr.dtype.element_ty), mask=ok[None, :])
    tl.store(s_ptr + row * s_stride + group + tl.arange(0, 1), scale)


def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` per ``1 x group`` to ``(fp8 [M, K], float32 scale [M, ceil(K / group)])``."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows, cols = x.shape
    groups = triton.cdiv(cols, group)
    q = torch.empty((rows, cols), dtype=FP8_DTYPE, device=x.device)
    s = torch.empty((rows, groups), dtype=torch.float32, device=x.device)
    if rows:
        _quantize_groups_kernel[(rows, groups)](
            x,
            q,
            s,
            cols,
            x.stride(0),
            q.stride(0),
            s.stride(0),
            FP8_MAX_=FP8_MAX,
            GROUP=group,
            GROUP_PAD=triton.next_power_of_2(group),
            ROUND_FIRST=os.environ.get("TRITON_INTERPRET") == "1",
        )
    return q, s


@triton.jit
def _fp8_gemm_kernel(
    a_ptr,
    a_scale_ptr,
    w_ptr,
    w_scale_ptr,
    bias_ptr,
    c_ptr,
    M,
    N,
    K,
    a_stride_m,
    a_scale_stride_m,
    w_stride_n,
    w_scale_stride_n,
    c_stride_m,
    SCALE_BO: tl.constexpr,
    SCALE_BI: tl.constexpr,
    QUANT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_m = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_ok = offs_m < M
    n_ok = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * a_stride_m + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * w_stride_n + offs_k[:, None]
    w_scale_ptrs = w_scale_ptr + (offs_n // SCALE_BO) * w_scale_stride_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        w_scale = tl.load(w_scale_ptrs + k0 // SCALE_BI, mask=n_ok, other=0.0)
        if QUANT:
            a_scale = tl.load(a_scale_ptr + offs_m * a_scale_stride_m + k0 // SCALE_BI, mask=m_ok, other=0.0)
            if UPCAST:
                part = tl.dot(a.to(tl.float32), w.to(tl.float32), input_precision="ieee")
            else:
                part = tl.dot(a, w)
            acc += part * a_scale[:, None] * w_scale[None, :]
        else:
            wd = w.to(tl.float32) * w_scale[None, :]
            if UPCAST:
                acc = tl.dot(a.to(tl.float32), wd, acc, input_precision=DOT_PRECISION)
            else:
                acc = tl.dot(a, wd.to(a.dtype), acc, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    c_ptrs = c_ptr + offs_m[:, None] * c_stride_m + offs_n[None, :]
    tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def fp8_linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale_inv: torch.Tensor,
    block: tuple[int, int],
    bias: torch.Tensor | None = None,
    mode: Fp8Mode = "dequant",
) -> torch.Tensor:
    """``x [..., K] @ dequant(weight [N, K])^T (+ bias)`` in ``x``'s dtype (``fp8.fp8_linear_torch``)."""
    lead, cols = x.shape[:-1], x.shape[-1]
    a = x.reshape(-1, cols)
    if a.stride(-1) != 1:
        a = a.contiguous()
    rows, n = a.shape[0], weight.shape[0]
    c = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows == 0:
        return c.reshape(*lead, n)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    tiles = fp8_gemm_tiles(rows, n, cols, block[1], mode)
    if mode == "quant":
        a, a_scale = quantize_activations(a, block[1])
    else:
        a_scale = scale_inv  # unread
    _fp8_gemm_kernel[(triton.cdiv(rows, tiles.block_m), triton.cdiv(n, tiles.block_n))](
        a,
        a_scale,
        weight,
        scale_inv,
        bias if bias is not None else scale_inv,
        c,
        rows,
        n,
        cols,
        a.stride(0),
        a_scale.stride(0),
        weight.stride(0),
        scale_inv.stride(0),
        c.stride(0),
        SCALE_BO=block[0],
        SCALE_BI=block[1],
        QUANT=mode == "quant",
        HAS_BIAS=bias is not None,
        # the interpreter multiplies bfloat16 and fp8 tiles as raw bit patterns; a GPU never upcasts
        UPCAST=interpreted,
        DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=tiles.block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
    )
    return c.reshape(*lead, n)
