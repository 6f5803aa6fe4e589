"""MLA's latent norm, rotary embedding and KV store as one Triton kernel.

Per token, the work of ``rms_norm`` on the latent, ``rope`` and ``kv_store`` in one launch::

    q_pe   [T, H, R]  ── rotate ──────────────────────────────▶ q_out [T, H, R] (contiguous)
    k_pe   [T, R]     ── rotate ───────────────┐
    latent [T, L]     ── rms_norm (weight) ──┐ │
                                             ▼ ▼
    kv_layer [num_pages, page_size, L + R]   row slot_mapping[t]: [ norm(latent) | rot(k_pe) ]

Program ``(t, b)`` for ``b < cdiv(H, BLOCK_H)`` rotates heads ``b*BLOCK_H ..`` of token ``t``;
program ``(t, cdiv(H, BLOCK_H))`` normalises the latent, rotates the key and writes the pool row.
A negative slot is padding: its query is still rotated, the pool is not touched (as
``kv_store_triton``). Rotation follows ``rope_triton``: pairs ``(x_2i, x_2i+1)`` with
``interleave``, ``(x_i, x_i+R/2)`` without, out as ``[x1*cos - x2*sin | x2*cos + x1*sin]``.

Rounding follows the unfused references: float32 math, the normalised latent rounded to the
activation dtype before the weight multiply and again after it, the rotated key rounded to the
activation dtype, then each cast to the pool dtype.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

# Heads per program: 16 heads x 64 rope dims keep a program's tile at 1,024 numbers.
HEADS_PER_PROGRAM = 16


@triton.jit
def _rope_kv_store_kernel(
    q_ptr,
    k_ptr,
    latent_ptr,
    norm_w_ptr,
    cos_ptr,
    sin_ptr,
    slot_ptr,
    q_out_ptr,
    kv_ptr,
    stride_q_t,
    stride_q_h,
    stride_k_t,
    stride_latent_t,
    stride_cos_t,
    stride_sin_t,
    stride_kv_page,
    stride_kv_slot,
    stride_kv_d,
    num_heads,
    page_size,
    eps,
    HALF: tl.constexpr,
    D_LATENT: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_LATENT: tl.constexpr,
):
    t = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    i = tl.arange(0, BLOCK_HALF)
    i_mask = i < HALF
    c = tl.load(cos_ptr + t * stride_cos_t + i, mask=i_mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + t * stride_sin_t + i, mask=i_mask, other=0.0).to(tl.float32)
    if INTERLEAVE:
        first = 2 * i
        second = 2 * i + 1
    else:
        first = i
        second = i + HALF
    act = q_out_ptr.dtype.element_ty

    if block * BLOCK_H < num_heads:
        heads = block * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (heads[:, None] < num_heads) & i_mask[None, :]
        q_row = q_ptr + t * stride_q_t + heads[:, None] * stride_q_h
        q1 = tl.load(q_row + first[None, :], mask=mask, other=0.0).to(tl.float32)
        q2 = tl.load(q_row + second[None, :], mask=mask, other=0.0).to(tl.float32)
        q_out = q_out_ptr + (t * num_heads + heads[:, None]) * (2 * HALF) + i[None, :]
        tl.store(q_out, (q1 * c[None, :] - q2 * s[None, :]).to(act), mask=mask)
        tl.store(q_out + HALF, (q2 * c[None, :] + q1 * s[None, :]).to(act), mask=mask)
    else:
        slot = tl.load(slot_ptr + t).to(tl.int64)
        if slot >= 0:
            pool = kv_ptr.dtype.element_ty
            row = kv_ptr + (slot // page_size) * stride_kv_page + (slot % page_size) * stride_kv_slot
            offs = tl.arange(0, BLOCK_LATENT)
            l_mask = offs < D_LATENT
            x = tl.load(latent_ptr + t * stride_latent_t + offs, mask=l_mask, other=0.0).to(tl.float32)
            variance = tl.sum(x * x, axis=0) / D_LATENT
            h = (x * tl.rsqrt(variance + eps)).to(act).to(tl.float32)
            w = tl.load(norm_w_ptr + offs, mask=l_mask, other=0.0).to(tl.float32)
            tl.store(row + offs * stride_kv_d, (w * h).to(act).to(pool), mask=l_mask)

            k1 = tl.load(k_ptr + t * stride_k_t + first, mask=i_mask, other=0.0).to(tl.float32)
            k2 = tl.load(k_ptr + t * stride_k_t + second, mask=i_mask, other=0.0).to(tl.float32)
            k_row = row + (D_LATENT + i) * stride_kv_d
            tl.store(k_row, (k1 * c - k2 * s).to(act).to(pool), mask=i_mask)
            tl.store(k_row + HALF * stride_kv_d, (k2 * c + k1 * s).to(act).to(pool), mask=i_mask)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    """Row-strided views pass as they are; only a strided last dim is copied."""
    return x if x.stride(-1) == 1 else x.contiguous()


def rope_kv_store_triton(
    q_pe: torch.Tensor,
    k_pe: torch.Tensor,
    latent: torch.Tensor,
    latent_norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    interleave: bool,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """Normalise ``latent [T, L]``, rotate ``q_pe [T, H, R]`` and ``k_pe [T, R]``, write
    ``[norm(latent) | rot(k_pe)]`` into ``kv_layer`` at ``slot_mapping``; return rotated ``q_pe``
    as a new contiguous tensor (the inputs are not changed)."""
    tokens, heads, rope_dim = q_pe.shape
    latent_dim = latent.shape[-1]
    if kv_layer.shape[-1] != latent_dim + rope_dim:
        raise ValueError(
            f"kv_layer rows hold {kv_layer.shape[-1]} numbers; "
            f"latent {latent_dim} + k_pe {rope_dim} do not fit"
        )
    q_pe, k_pe, latent, cos, sin = (_unit_last(x) for x in (q_pe, k_pe, latent, cos, sin))
    q_out = torch.empty((tokens, heads, rope_dim), dtype=q_pe.dtype, device=q_pe.device)
    if tokens == 0:
        return q_out
    half = rope_dim // 2
    block_h = min(triton.next_power_of_2(heads), HEADS_PER_PROGRAM)
    grid = (tokens, triton.cdiv(heads, block_h) + 1)
    # Triton launches on the current CUDA device, not necessarily the pool's
    guard = torch.cuda.device(kv_layer.device) if kv_layer.is_cuda else contextlib.nullcontext()
    with guard:
        _rope_kv_store_kernel[grid](
            q_pe,
            k_pe,
            latent,
            latent_norm_weight,
            cos,
            sin,
            slot_mapping,
            q_out,
            kv_layer,
            q_pe.stride(0),
            q_pe.stride(1),
            k_pe.stride(0),
            latent.stride(0),
            cos.stride(0),
            sin.stride(0),
            kv_layer.stride(0),
            kv_layer.stride(1),
            kv_layer.stride(2),
            heads,
            kv_layer.shape[1],
            eps,
            HALF=half,
            D_LATENT=latent_dim,
            INTERLEAVE=interleave,
            BLOCK_H=block_h,
            BLOCK_HALF=triton.next_power_of_2(half),
            BLOCK_LATENT=triton.next_power_of_2(latent_dim),
            num_warps=4,
        )
    return q_out
