"""Absorbed MLA decode over the paged latent pool, in Triton (flash-decoding in two stages).

Every head of a request attends to the same latent tokens ``[c | k_pe]`` (one KV "head" shared
by all ``H`` query heads), so a program takes a block of ``BLOCK_H`` heads at once: one load of a
KV tile serves ``BLOCK_H`` rows of the score matmul. Stage 1 also cuts each request's KV length
into ``num_kv_splits`` tile-aligned, contiguous splits so that a long request fills the GPU::

    stage 1, grid (cdiv(H, BLOCK_H), B, num_kv_splits): the head blocks of one (request, split)
    are launched side by side, so the later ones find its KV tiles in L2 rather than HBM

      request b:  tokens 0 ............................................ seq_len-1
                  | split 0        | split 1        | split 2    |   (split 3: empty)
                    └ BLOCK_N tiles, each token read through the page table:
                      kv_layer[page_table[b, j // page_size], j % page_size] = [c_j | k_pe_j]

      scores = (q_latent·c + q_pe·k_pe) * scale      [BLOCK_H, BLOCK_N]   (tl.dot, fp32 accumulate)
      online softmax over the split  ->  partial_out [B, H, S, L] = softmax-weighted sum of c
                                         partial_lse [B, H, S]    = log2-sum-exp of the scores

    stage 2, grid (B, H)

      out[b, h] = sum_s 2^(lse_s - max lse) * partial_out_s / sum_s 2^(lse_s - max lse)

An empty split (a short request batched with a long one) writes ``lse = -inf`` and no partial
output; stage 2 gives it weight 0 and never reads its partial output, so it adds nothing and no
NaN. A request with no tokens at all comes out as zeros, like the torch reference. Scores are
kept in base 2 (``scale * log2(e)`` folded in) so the exponentials are ``exp2``.

Split count (see :func:`choose_num_kv_splits`): enough splits to give the GPU about
``PROGRAMS_PER_SM`` programs per SM, about ``MIN_TOKENS_PER_SPLIT`` tokens per split at least,
at most ``MAX_KV_SPLITS``. A split costs one ``[BLOCK_H, L]`` float32 partial write and read in
stage 2 (32 KiB for 16 heads, L=512) against at least 256 tokens x 576 numbers of KV read in
stage 1 (288 KiB in bfloat16), so splitting is cheap where it fills idle SMs: one request of 32k
tokens with H=128 gets 8 head blocks x 16 splits = 128 programs instead of 8. A large batch
already fills the GPU and gets one split. The result depends on the split count only by float
rounding (the merge reorders the sum).
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import TYPE_CHECKING, Any

import torch
import triton
import triton.language as tl

from tandem.model.kernels.tuning import DEFAULT_MLA_DECODE, DecodeTiles, mla_decode_tiles

if TYPE_CHECKING:
    from tandem.model.attention_metadata import AttentionMetadata

# the default tiles (``model/kernels/tuning.py`` holds them per GPU kind): heads per program, the
# M dimension of the score matmul (tl.dot needs >= 16); KV tokens per tile and warps for 16-bit
# inputs, then float32/float64 (half the tile, twice the warps, so that at L=512 neither spills
# registers on sm_90)
BLOCK_H = DEFAULT_MLA_DECODE["narrow"].block_h
BLOCK_N, NUM_WARPS = DEFAULT_MLA_DECODE["narrow"].block_n, DEFAULT_MLA_DECODE["narrow"].num_warps
BLOCK_N_WIDE, NUM_WARPS_WIDE = DEFAULT_MLA_DECODE["wide"].block_n, DEFAULT_MLA_DECODE["wide"].num_warps
MIN_TOKENS_PER_SPLIT = 256
MAX_KV_SPLITS = 16
PROGRAMS_PER_SM = 4
DEFAULT_NUM_SMS = 132  # H200 / H100 SXM; used when the tensors are not on a CUDA device
LOG2E = 1.4426950408889634


@triton.jit
def _decode_split_kernel(
    q_ptr,
    q_pe_ptr,
    kv_ptr,
    page_table_ptr,
    seq_lens_ptr,
    part_out_ptr,
    part_lse_ptr,
    scale_log2,
    num_heads,
    num_kv_splits,
    stride_q_b,
    stride_q_h,
    stride_q_d,
    stride_qpe_b,
    stride_qpe_h,
    stride_qpe_d,
    stride_kv_page,
    stride_kv_slot,
    stride_kv_d,
    stride_pt_b,
    stride_pt_p,
    PAGE_SIZE: tl.constexpr,
    D_LATENT: tl.constexpr,
    D_PE: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
    BLOCK_DPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    ACC_DTYPE: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    head_block = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    split = tl.program_id(2)

    offs_h = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < num_heads
    offs_d = tl.arange(0, BLOCK_DMODEL)
    mask_d = offs_d < D_LATENT
    offs_pe = tl.arange(0, BLOCK_DPE)
    mask_pe = offs_pe < D_PE

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_kv_splits), BLOCK_N) * BLOCK_N
    split_start = split * split_len
    split_end = tl.minimum(split_start + split_len, seq_len)

    q = tl.load(
        q_ptr + b * stride_q_b + offs_h[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
        mask=mask_h[:, None] & mask_d[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    q_pe = tl.load(
        q_pe_ptr + b * stride_qpe_b + offs_h[:, None] * stride_qpe_h + offs_pe[None, :] * stride_qpe_d,
        mask=mask_h[:, None] & mask_pe[None, :],
        other=0.0,
    ).to(DOT_DTYPE)

    m_i = tl.full([BLOCK_H], float("-inf"), dtype=ACC_DTYPE)
    l_i = tl.zeros([BLOCK_H], dtype=ACC_DTYPE)
    acc = tl.zeros([BLOCK_H, BLOCK_DMODEL], dtype=ACC_DTYPE)
    page_row = page_table_ptr + b * stride_pt_b
    for start_n in range(split_start, split_end, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        mask_n = offs_n < split_end
        page = tl.load(page_row + (offs_n // PAGE_SIZE) * stride_pt_p, mask=mask_n, other=0).to(tl.int64)
        token = kv_ptr + page * stride_kv_page + (offs_n % PAGE_SIZE).to(tl.int64) * stride_kv_slot
        c = tl.load(
            token[:, None] + offs_d[None, :] * stride_kv_d, mask=mask_n[:, None] & mask_d[None, :], other=0.0
        )
        k_pe = tl.load(
            token[:, None] + (D_LATENT + offs_pe[None, :]) * stride_kv_d,
            mask=mask_n[:, None] & mask_pe[None, :],
            other=0.0,
        )

        c = c.to(DOT_DTYPE)
        scores = tl.dot(q, tl.trans(c), input_precision=DOT_PRECISION)
        scores = tl.dot(q_pe, tl.trans(k_pe.to(DOT_DTYPE)), acc=scores, input_precision=DOT_PRECISION)
        scores = tl.where(mask_n[None, :], scores * scale_log2, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        p = p.to(q_ptr.dtype.element_ty).to(DOT_DTYPE)  # rounded like the queries
        acc = tl.dot(p, c, acc=acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    # [B, H, S, L] and [B, H, S], both contiguous
    part = (b * num_heads + offs_h).to(tl.int64) * num_kv_splits + split
    has_tokens = split_end > split_start
    lse = tl.where(has_tokens, m_i + tl.log2(tl.where(has_tokens, l_i, 1.0)), float("-inf"))
    tl.store(part_lse_ptr + part, lse, mask=mask_h)
    if has_tokens:
        out = acc / l_i[:, None]
        tl.store(
            part_out_ptr + part[:, None] * D_LATENT + offs_d[None, :],
            out,
            mask=mask_h[:, None] & mask_d[None, :],
        )


@triton.jit
def _decode_merge_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_heads,
    num_kv_splits,
    stride_out_b,
    stride_out_h,
    stride_out_d,
    D_LATENT: tl.constexpr,
    BLOCK_DMODEL: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_DMODEL)
    mask_d = offs_d < D_LATENT

    part = (b * num_heads + h) * num_kv_splits + offs_s
    lse = tl.load(part_lse_ptr + part, mask=offs_s < num_kv_splits, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weight = tl.exp2(lse - lse_max)
    filled = lse > float("-inf")  # empty splits wrote no partial output: never read it
    partial = tl.load(
        part_out_ptr + part[:, None] * D_LATENT + offs_d[None, :],
        mask=filled[:, None] & mask_d[None, :],
        other=0.0,
    )
    total = tl.sum(weight, 0)
    out = tl.sum(partial * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(
        out_ptr + b * stride_out_b + h * stride_out_h + offs_d * stride_out_d,
        out.to(out_ptr.dtype.element_ty),
        mask=mask_d,
    )


def choose_num_kv_splits(
    max_seq_len: int, batch_size: int, num_heads: int, num_sms: int, block_h: int = BLOCK_H
) -> int:
    """KV splits per request: fill ``PROGRAMS_PER_SM * num_sms`` programs, keep splits >= 256 tokens."""
    by_length = math.ceil(max_seq_len / MIN_TOKENS_PER_SPLIT)
    programs_per_split = max(1, batch_size * math.ceil(num_heads / block_h))
    by_occupancy = math.ceil(PROGRAMS_PER_SM * num_sms / programs_per_split)
    return max(1, min(by_length, by_occupancy, MAX_KV_SPLITS))


def _num_sms(device: torch.device) -> int:
    return _cuda_sms(device.index or 0) if device.type == "cuda" else DEFAULT_NUM_SMS


@functools.cache
def _cuda_sms(index: int) -> int:
    return int(torch.cuda.get_device_properties(index).multi_processor_count)


def on_device(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """Make ``device`` current for a launch: Triton launches on the current CUDA device."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def decode_attention_triton(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Absorbed MLA for single-token rows: ``q_latent [B, H, L]``, ``q_pe [B, H, R]`` -> ``[B, H, L]``."""
    batch_size, num_heads, _ = q_latent.shape
    tiles = decode_tiles(q_latent)
    max_seq_len = meta.max_seq_len or max(meta.seq_lens, default=0)
    splits = choose_num_kv_splits(
        max_seq_len, batch_size, num_heads, _num_sms(q_latent.device), tiles.block_h
    )
    return decode_attention_splits(q_latent, q_pe, kv_layer, meta, scale, splits, tiles=tiles)


def decode_tiles(q_latent: torch.Tensor) -> DecodeTiles:
    """The tiles of this GPU kind for the queries' width (``tuning.mla_decode_tiles``)."""
    return mla_decode_tiles(q_latent.element_size() <= 2)


def decode_attention_splits(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    num_kv_splits: int,
    block_n: int | None = None,
    tiles: DecodeTiles | None = None,
) -> torch.Tensor:
    """:func:`decode_attention_triton` with a given split count (and tiles; ``block_n`` overrides
    theirs)."""
    batch_size, num_heads, latent_dim = q_latent.shape
    pe_dim = q_pe.shape[-1]
    if kv_layer.shape[-1] != latent_dim + pe_dim:
        raise ValueError(f"kv_layer rows hold {kv_layer.shape[-1]} numbers, queries {latent_dim} + {pe_dim}")
    out = torch.empty_like(q_latent)
    if batch_size == 0 or num_heads == 0:
        return out
    device = q_latent.device
    acc_dtype = torch.float64 if q_latent.dtype == torch.float64 else torch.float32
    part_out = torch.empty((batch_size, num_heads, num_kv_splits, latent_dim), dtype=acc_dtype, device=device)
    part_lse = torch.empty((batch_size, num_heads, num_kv_splits), dtype=acc_dtype, device=device)
    block_dmodel = max(16, triton.next_power_of_2(latent_dim))
    page_table = meta.page_table
    dot_dtype, dot_precision = dot_operands(q_latent.dtype, device)
    tiles = tiles or decode_tiles(q_latent)
    with on_device(device):
        _decode_split_kernel[(triton.cdiv(num_heads, tiles.block_h), batch_size, num_kv_splits)](
            q_latent,
            q_pe,
            kv_layer,
            page_table,
            meta.seq_lens_t,
            part_out,
            part_lse,
            scale * LOG2E,
            num_heads,
            num_kv_splits,
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
            PAGE_SIZE=meta.page_size,
            D_LATENT=latent_dim,
            D_PE=pe_dim,
            BLOCK_DMODEL=block_dmodel,
            BLOCK_DPE=max(16, triton.next_power_of_2(pe_dim)),
            BLOCK_H=tiles.block_h,
            BLOCK_N=block_n or tiles.block_n,
            ACC_DTYPE=tl.float64 if acc_dtype == torch.float64 else tl.float32,
            DOT_DTYPE=dot_dtype,
            DOT_PRECISION=dot_precision,
            num_warps=tiles.num_warps,
            num_stages=tiles.num_stages,
        )
        _decode_merge_kernel[(batch_size, num_heads)](
            part_out,
            part_lse,
            out,
            num_heads,
            num_kv_splits,
            out.stride(0),
            out.stride(1),
            out.stride(2),
            D_LATENT=latent_dim,
            BLOCK_DMODEL=block_dmodel,
            BLOCK_S=triton.next_power_of_2(num_kv_splits),
            num_warps=4,
        )
    return out


def dot_operands(dtype: torch.dtype, device: torch.device) -> tuple[tl.dtype, str]:
    """The dtype ``tl.dot`` operands are cast to, and its ``input_precision``.

    On a GPU the operands keep the input dtype (tensor cores for bfloat16/float16; full ``ieee``
    products for float32/float64, which would otherwise be rounded to TF32). Triton's interpreter
    (tensors on a CPU) multiplies bfloat16 operands as their raw 16-bit storage, so there they are
    widened to float32 first: exact, and the same products a bfloat16 MMA accumulates in float32.
    """
    names = {torch.float32: tl.float32, torch.float64: tl.float64, torch.float16: tl.float16}
    if dtype == torch.bfloat16:
        dot_dtype = tl.bfloat16 if device.type == "cuda" else tl.float32
    elif dtype in names:
        dot_dtype = names[dtype]
    else:
        raise TypeError(f"MLA attention kernels take float16, bfloat16, float32 or float64, not {dtype}")
    return dot_dtype, "ieee" if dot_dtype in (tl.float32, tl.float64) else "tf32"
