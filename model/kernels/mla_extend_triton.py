"""MLA extend attention in the absorbed form, over the paged latent pool in place, in Triton.

The extend rows (several new tokens per request, after a prefix already in the pool) take
``q [T, H, nope+R]`` and return ``[T, H, v]`` exactly as the plain-form reference does, computed as

    q_latent[t, h] = q_nope[t, h] @ w_uk[h]              [T, H, L]   (torch einsum)
    o_latent[t, h] = causal softmax((q_latent·c + q_pe·k_pe) * scale) @ c    (Triton, below)
    out[t, h]      = o_latent[t, h] @ w_uv[h]^T          [T, H, v]   (torch einsum)

with ``w_kv_b [H*(nope+v), L]`` viewed as ``[H, nope+v, L]`` = ``[w_uk | w_uv]`` per head. The
keys are the pool rows ``[c | k_pe]`` and the values their ``c``, read through the page table:
nothing of the prefix is expanded or copied.

Why absorbed: the plain form must run ``kv_b_proj`` over every prefix token of every request at
every step (``2·S·L·H·(nope+v)`` FLOPs and an ``[S, H, nope+v]`` buffer for ``S`` = prefix + new
tokens) before attending, because the pool holds only latents. The absorbed form reads each page
where it lies; what it pays instead is wider attention. Per layer and request, ``n`` new tokens,
``S`` keys, ``S'`` ~ the average causal key count per query:

    plain     2·S·L·H·(nope+v)  +  2·n·S'·H·(nope+R + v)
    absorbed  2·n·H·L·(nope+v)  +  2·n·S'·H·(L+R + L)

DeepSeek-V3 (L=512, R=64, nope=v=128): attention is 1088 vs 320 FLOPs per (query, key, head),
and the prefix expansion costs 131072 per (key, head); with a long prefix (S' ~ S) the absorbed
form does fewer FLOPs while ``n < 131072 / 768 ~ 170`` new tokens, and it never moves the prefix.
Long chunks over a short prefix are cheaper in the plain form (the torch reference); so are
its buffers: the latent query and output are ``T·H·L`` each.

Kernel: grid ``(cdiv(max_query_len, BLOCK_M), B, cdiv(H, BLOCK_H))``. A program holds
``BLOCK_M`` queries x ``BLOCK_H`` heads as ``ROWS = BLOCK_M·BLOCK_H`` rows of one matmul (all heads
share the latent keys, so a KV tile loaded once serves every row); short extends pack more heads::

    row r  ->  query  m = m_start + r // BLOCK_H,   head  h = h_start + r % BLOCK_H

    request b: prefix p = seq_len - query_len
    pool positions  0 ................ p-1 | p ....... p+query_len-1
    query m sees    0 ........................... p+m           (causal; its own token included)

Tiles of ``BLOCK_N`` keys run from 0 to ``p + min(m_start + BLOCK_M, query_len)``, the causal
limit of the program's last query; tiles wholly beyond it are never loaded. Online softmax and
the accumulators are float32 (float64 for float64 inputs); scores are in base 2.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from tandem.model.kernels.mla_decode_triton import LOG2E, dot_operands, on_device

if TYPE_CHECKING:
    from tandem.model.attention_metadata import AttentionMetadata

# query x head rows per program (the M dimension of the score matmul, >= 16) and KV tokens per
# tile: 16-bit inputs, then float32/float64, smaller so that at L=512 neither spills on sm_90
ROWS, BLOCK_N = 32, 32
ROWS_WIDE, BLOCK_N_WIDE = 16, 16
NUM_WARPS = 8


@triton.jit
def _extend_kernel(
    q_ptr,
    q_pe_ptr,
    kv_ptr,
    page_table_ptr,
    query_start_ptr,
    seq_lens_ptr,
    out_ptr,
    scale_log2,
    num_heads,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_qpe_t,
    stride_qpe_h,
    stride_qpe_d,
    stride_kv_page,
    stride_kv_slot,
    stride_kv_d,
    stride_pt_b,
    stride_pt_p,
    stride_out_t,
    stride_out_h,
    stride_out_d,
    PAGE_SIZE: tl.constexpr,
    D_LATENT: tl.constexpr,
    D_PE: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    m_start = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1).to(tl.int64)
    h_start = tl.program_id(2) * BLOCK_H

    q_start = tl.load(query_start_ptr + b)
    query_len = (tl.load(query_start_ptr + b + 1) - q_start).to(tl.int32)
    if m_start < query_len:
        prefix_len = tl.load(seq_lens_ptr + b).to(tl.int32) - query_len

        offs_r = tl.arange(0, BLOCK_M * BLOCK_H)
        offs_m = m_start + offs_r // BLOCK_H
        offs_h = h_start + offs_r % BLOCK_H
        mask_r = (offs_m < query_len) & (offs_h < num_heads)
        offs_d = tl.arange(0, BLOCK_DMODEL)
        mask_d = offs_d < D_LATENT
        offs_pe = tl.arange(0, BLOCK_DPE)
        mask_pe = offs_pe < D_PE
        token = q_start + offs_m.to(tl.int64)

        q = tl.load(
            q_ptr + token[:, None] * stride_q_t + offs_h[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
            mask=mask_r[:, None] & mask_d[None, :],
            other=0.0,
        ).to(DOT_DTYPE)
        q_pe = tl.load(
            q_pe_ptr
            + token[:, None] * stride_qpe_t
            + offs_h[:, None] * stride_qpe_h
            + offs_pe[None, :] * stride_qpe_d,
            mask=mask_r[:, None] & mask_pe[None, :],
            other=0.0,
        ).to(DOT_DTYPE)

        # Rows past query_len see keys up to their (absent) position: never empty, never stored.
        causal_limit = prefix_len + offs_m
        kv_end = prefix_len + tl.minimum(m_start + BLOCK_M, query_len)

        m_i = tl.full([BLOCK_M * BLOCK_H], float("-inf"), dtype=ACC_DTYPE)
        l_i = tl.zeros([BLOCK_M * BLOCK_H], dtype=ACC_DTYPE)
        acc = tl.zeros([BLOCK_M * BLOCK_H, BLOCK_DMODEL], dtype=ACC_DTYPE)
        page_row = page_table_ptr + b * stride_pt_b
        for start_n in range(0, kv_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < kv_end
            page = tl.load(page_row + (offs_n // PAGE_SIZE) * stride_pt_p, mask=mask_n, other=0).to(tl.int64)
            kv_row = kv_ptr + page * stride_kv_page + (offs_n % PAGE_SIZE).to(tl.int64) * stride_kv_slot
            c = tl.load(
                kv_row[:, None] + offs_d[None, :] * stride_kv_d,
                mask=mask_n[:, None] & mask_d[None, :],
                other=0.0,
            ).to(DOT_DTYPE)
            k_pe = tl.load(
                kv_row[:, None] + (D_LATENT + offs_pe[None, :]) * stride_kv_d,
                mask=mask_n[:, None] & mask_pe[None, :],
                other=0.0,
            ).to(DOT_DTYPE)

            scores = tl.dot(q, tl.trans(c), input_precision=DOT_PRECISION)
            scores = tl.dot(q_pe, tl.trans(k_pe), acc=scores, input_precision=DOT_PRECISION)
            visible = (offs_n[None, :] <= causal_limit[:, None]) & mask_n[None, :]
            scores = tl.where(visible, scores * scale_log2, float("-inf"))

            # key 0 is visible to every row, so m_i is finite from the first tile on
            m_new = tl.maximum(m_i, tl.max(scores, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(scores - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            p = p.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)  # rounded like the queries
            acc = tl.dot(p, c, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new

        out = acc / l_i[:, None]
        tl.store(
            out_ptr
            + token[:, None] * stride_out_t
            + offs_h[:, None] * stride_out_h
            + offs_d[None, :] * stride_out_d,
            out.to(out_ptr.dtype.element_ty),
            mask=mask_r[:, None] & mask_d[None, :],
        )


def extend_attention_triton(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    w_kv_b: torch.Tensor,
    num_heads: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    """MLA for the extend rows: ``q [T, H, nope+R]`` -> ``[T, H, v]``, causal over prefix + self."""
    num_tokens = q.shape[0]
    latent_dim = w_kv_b.shape[1]
    w = w_kv_b.view(num_heads, qk_nope_head_dim + v_head_dim, latent_dim)
    w_uk, w_uv = w[:, :qk_nope_head_dim], w[:, qk_nope_head_dim:]
    if num_tokens == 0:
        return q.new_empty((0, num_heads, v_head_dim))
    q_latent = torch.einsum("thn,hnl->thl", q[..., :qk_nope_head_dim], w_uk)
    o_latent = extend_attention_latent(q_latent, q[..., qk_nope_head_dim:], kv_layer, meta, scale)
    return torch.einsum("thl,hvl->thv", o_latent, w_uv)


def extend_attention_latent(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    rows: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """The latent-space part: ``q_latent [T, H, L]``, ``q_pe [T, H, R]`` -> ``o_latent [T, H, L]``."""
    num_tokens, num_heads, latent_dim = q_latent.shape
    pe_dim = q_pe.shape[-1]
    if kv_layer.shape[-1] != latent_dim + pe_dim:
        raise ValueError(f"kv_layer rows hold {kv_layer.shape[-1]} numbers, queries {latent_dim} + {pe_dim}")
    out = torch.empty_like(q_latent)
    max_query_len = max(meta.query_lens, default=0)
    if num_tokens == 0 or num_heads == 0 or max_query_len == 0:
        return out
    narrow = q_latent.element_size() <= 2
    rows = rows or (ROWS if narrow else ROWS_WIDE)
    block_n = block_n or (BLOCK_N if narrow else BLOCK_N_WIDE)
    block_h = min(triton.next_power_of_2(num_heads), max(1, rows // triton.next_power_of_2(max_query_len)))
    block_m = rows // block_h
    dot_dtype, dot_precision = dot_operands(q_latent.dtype, q_latent.device)
    page_table = meta.page_table
    grid = (triton.cdiv(max_query_len, block_m), len(meta.query_lens), triton.cdiv(num_heads, block_h))
    with on_device(q_latent.device):
        _extend_kernel[grid](
            q_latent,
            q_pe,
            kv_layer,
            page_table,
            meta.query_start,
            meta.seq_lens_t,
            out,
            scale * LOG2E,
            num_heads,
            q_latent.stride(0),
            q_latent.stride(1),
            q_latent.stride(2),
            q_pe.stride(0),
            q_pe.stride(1),
            q_pe.stride(2),
            kv_layer.stride(0),
            kv_layer.stride(1),
            kv_layer.stride(2),
            page_table.stride(0),
            page_table.stride(1),
            out.stride(0),
            out.stride(1),
            out.stride(2),
            PAGE_SIZE=meta.page_size,
            D_LATENT=latent_dim,
            D_PE=pe_dim,
            BLOCK_DMODEL=max(16, triton.next_power_of_2(latent_dim)),
            BLOCK_DPE=max(16, triton.next_power_of_2(pe_dim)),
            BLOCK_M=block_m,
            BLOCK_H=block_h,
            BLOCK_N=block_n,
            ACC_DTYPE=tl.float64 if q_latent.dtype == torch.float64 else tl.float32,
            DOT_DTYPE=dot_dtype,
            DOT_PRECISION=dot_precision,
            num_warps=NUM_WARPS,
            num_stages=2,
        )
    return out
