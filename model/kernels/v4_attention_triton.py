"""DeepSeek-V4's sparse attention with sinks, in Triton: each query row attends to the keys its
index list names (``sparse_attention_torch`` in ``v4_attention.py`` is the reference).

Grid ``(T, cdiv(H, BLOCK_H))``: a program holds one query row's ``BLOCK_H`` heads (they share the
row's keys: one KV head, K = V) and walks its index list ``BLOCK_N`` entries a tile, gathering
those rows of the step's key buffer; an index of ``-1`` is skipped (never loaded). The online
softmax starts from the sink: the running maximum is the head's sink logit and the running sum
1, so the sink takes its share of probability and adds nothing to the output. Scores are in
base 2, the softmax state and the accumulator float32; the probabilities are rounded to the keys'
dtype for the second matmul, as the reference rounds them.

Decode rows and prefill rows take the same path (every row has its own list: window and picked
entries), so a mixed step is one launch a layer."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.model.kernels.mla_decode_triton import LOG2E, dot_operands, on_device

BLOCK_H = 16  # the M dimension of the score matmul (>= 16)
BLOCK_N = 32  # keys a tile; 16 for float32/float64 so that a 512-wide head does not spill
BLOCK_N_WIDE = 16


@triton.jit
def _sparse_attention_kernel(
    q_ptr,
    kv_ptr,
    idx_ptr,
    sink_ptr,
    out_ptr,
    scale_log2,
    num_heads,
    head_dim,
    num_idx,
    stride_q_t,
    stride_q_h,
    stride_kv,
    stride_idx,
    stride_o_t,
    stride_o_h,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    h_mask, d_mask = heads < num_heads, dims < head_dim
    q = tl.load(
        q_ptr + row * stride_q_t + heads[:, None] * stride_q_h + dims[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    # the sink (base 2) is the first "key": running max = its logit, running sum = 2^0 = 1
    m_i = tl.load(sink_ptr + heads, mask=h_mask, other=0.0)
    l_i = tl.full([BLOCK_H], 1.0, dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for start in range(0, num_idx, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        idx = tl.load(idx_ptr + row * stride_idx + cols, mask=cols < num_idx, other=-1)
        valid = idx >= 0
        k = tl.load(
            kv_ptr + idx.to(tl.int64)[:, None] * stride_kv + dims[None, :],
            mask=valid[:, None] & d_mask[None, :],
            other=0.0,
        )
        scores = tl.dot(q, tl.trans(k.to(DOT_DTYPE)), input_precision=DOT_PRECISION) * scale_log2
        scores = tl.where(valid[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        p = p.to(kv_ptr.dtype.element_ty).to(DOT_DTYPE)
        acc = tl.dot(p, k.to(DOT_DTYPE), acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    out = acc / l_i[:, None]
    tl.store(
        out_ptr + row * stride_o_t + heads[:, None] * stride_o_h + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=h_mask[:, None] & d_mask[None, :],
    )


def sparse_attention_triton(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [T, H, D]``, ``kv [N, D]``, ``indices [T, K]`` int32 (``-1``: none), ``sink [H]`` float32
    -> ``[T, H, D]`` in ``q``'s dtype."""
    tokens, heads, dim = q.shape
    out = torch.empty_like(q)
    if tokens == 0:
        return out
    if q.stride(-1) != 1:
        q = q.contiguous()
    kv, indices = kv.contiguous(), indices.to(torch.int32).contiguous()
    sink_log2 = (sink.float() * LOG2E).contiguous()
    dot_dtype, precision = dot_operands(q.dtype, q.device)
    wide = dot_dtype in (tl.float32, tl.float64)
    with on_device(q.device):
        _sparse_attention_kernel[(tokens, triton.cdiv(heads, BLOCK_H))](
            q,
            kv,
            indices,
            sink_log2,
            out,
            scale * LOG2E,
            heads,
            dim,
            indices.shape[1],
            q.stride(0),
            q.stride(1),
            kv.stride(0),
            indices.stride(0),
            out.stride(0),
            out.stride(1),
            BLOCK_H=BLOCK_H,
            BLOCK_N=BLOCK_N_WIDE if wide else BLOCK_N,
            BLOCK_D=triton.next_power_of_2(dim),
            DOT_DTYPE=dot_dtype,
            DOT_PRECISION=precision,
        )
    return out
