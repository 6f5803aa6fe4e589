"""Rotary embedding of the MLA rope parts in Triton (YaRN lives in the cos/sin table).

One program rotates one token: its query rope part for every head and its single rope key::

    in  (interleave)   x = [x0 x1 | x2 x3 | ...]         pairs (x_2i, x_2i+1)
    in  (half split)   x = [x0 .. x_{R/2-1} | x_{R/2} ..] pairs (x_i, x_{i+R/2})
    out                [x1*cos - x2*sin | x2*cos + x1*sin]   (both layouts)

``cos``/``sin`` are ``[T, R/2]``: the token's row of the table, already in the activation dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope_kernel(
    q_ptr,
    k_ptr,
    cos_ptr,
    sin_ptr,
    q_out_ptr,
    k_out_ptr,
    q_stride_t,
    q_stride_h,
    k_stride_t,
    num_heads,
    HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    c = tl.load(cos_ptr + t * HALF + i, mask=i_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * HALF + i, mask=i_mask, other=0.0).to(tl.float32)
    if INTERLEAVE:
        first = 2 * i
        second = 2 * i + 1
    else:
        first = i
        second = i + HALF

    heads = tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < num_heads) & i_mask[None, :]
    q_row = q_ptr + t * q_stride_t + heads[:, None] * q_stride_h
    q1 = tl.load(q_row + first[None, :], mask=mask, other=0.0).to(tl.float32)
    q2 = tl.load(q_row + second[None, :], mask=mask, other=0.0).to(tl.float32)
    q_out = q_out_ptr + t * num_heads * 2 * HALF + heads[:, None] * 2 * HALF + i[None, :]
    dtype = q_out_ptr.dtype.element_ty
    tl.store(q_out, (q1 * c[None, :] - q2 * s[None, :]).to(dtype), mask=mask)
    tl.store(q_out + HALF, (q2 * c[None, :] + q1 * s[None, :]).to(dtype), mask=mask)

    k1 = tl.load(k_ptr + t * k_stride_t + first, mask=i_mask, other=0.0).to(tl.float32)
    k2 = tl.load(k_ptr + t * k_stride_t + second, mask=i_mask, other=0.0).to(tl.float32)
    k_out = k_out_ptr + t * 2 * HALF + i
    tl.store(k_out, (k1 * c - k2 * s).to(dtype), mask=i_mask)
    tl.store(k_out + HALF, (k2 * c + k1 * s).to(dtype), mask=i_mask)


def apply_rope_triton(
    q_pe: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``q_pe [T, H, R]`` and ``k_pe [T, R]`` (row-strided views are fine) -> new contiguous tensors."""
    tokens, heads, rope_dim = q_pe.shape
    if q_pe.stride(-1) != 1:
        q_pe = q_pe.contiguous()
    if k_pe.stride(-1) != 1:
        k_pe = k_pe.contiguous()
    q_out = torch.empty((tokens, heads, rope_dim), dtype=q_pe.dtype, device=q_pe.device)
    k_out = torch.empty((tokens, rope_dim), dtype=k_pe.dtype, device=k_pe.device)
    if tokens:
        half = rope_dim // 2
        _rope_kernel[(tokens,)](
            q_pe,
            k_pe,
            cos.contiguous(),
            sin.contiguous(),
            q_out,
            k_out,
            q_pe.stride(0),
            q_pe.stride(1),
            k_pe.stride(0),
            heads,
            HALF=half,
            INTERLEAVE=interleave,
            BLOCK_H=triton.next_power_of_2(heads),
            BLOCK_HALF=triton.next_power_of_2(half),
        )
    return q_out, k_out
