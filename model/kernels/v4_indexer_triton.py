"""CSA's lightning indexer in Triton: the scores, then a top-k that gives exact ties to the lowest
entry index by construction (``indexer_topk_torch`` in ``v4_attention.py`` is the reference).

1. **Scores**, grid ``(T, cdiv(max visible, BLOCK_E))``: a program takes one query row's heads
   ``q [H, d]`` and ``BLOCK_E`` of its request's keys, ``ReLU(q . k^T) * scale`` weighted by the
   row's head weights and summed over the heads in float32, written as an int32 key that orders
   as the score does (``-0.0``, which an entry whose clipped heads all have negative weights
   scores, gets the key of ``0.0``: they are equal).
2. **Select**, grid ``(T,)``: a radix select on the scores' order-preserving integer keys finds
   the ``k``-th largest score ``s*`` in four histogram passes over the row (a byte a pass, the
   highest first), then one pass writes, in ascending entry order, every entry above ``s*`` and
   the first ``k - #above`` entries equal to it: the lowest indices among the tied, whatever the
   row's length, batch or the step's shape. A row that sees ``k`` entries or fewer takes them all.

The keys of a chunk of rows live in an int32 buffer ``[rows, max visible]``; rows go through
in chunks of at most ``SCORE_BUFFER_BYTES`` so a long prompt over a long context stays bounded.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.model.kernels.mla_decode_triton import dot_operands, on_device

BLOCK_E = 32  # entries a score tile
BLOCK_SELECT = 256  # entries a select pass reads at a time
SCORE_BUFFER_BYTES = 256 << 20


@triton.jit
def _indexer_scores_kernel(
    q_ptr,
    w_ptr,
    keys_ptr,
    starts_ptr,
    counts_ptr,
    scores_ptr,
    scale,
    num_heads,
    head_dim,
    stride_q_t,
    stride_q_h,
    stride_w,
    stride_keys,
    stride_s,
    BLOCK_H: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    entries = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
    count = tl.load(counts_ptr + row)
    start = tl.load(starts_ptr + row).to(tl.int64)
    heads, dims = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    h_mask, d_mask, e_mask = heads < num_heads, dims < head_dim, entries < count
    q = tl.load(
        q_ptr + row * stride_q_t + heads[:, None] * stride_q_h + dims[None, :],
        mask=h_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    k = tl.load(
        keys_ptr + (start + entries)[:, None] * stride_keys + dims[None, :],
        mask=e_mask[:, None] & d_mask[None, :],
        other=0.0,
    ).to(DOT_DTYPE)
    w = tl.load(w_ptr + row * stride_w + heads, mask=h_mask, other=0.0).to(tl.float32)
    s = tl.maximum(tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION), 0.0) * scale  # [H, E]
    total = tl.sum(s * w[:, None], axis=0)
    # as a key that orders as the score does, -0.0 one key with 0.0 (they are equal)
    bits = tl.where(total == 0.0, 0.0, total).to(tl.int32, bitcast=True)
    tl.store(scores_ptr + row * stride_s + entries, tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits), mask=e_mask)


@triton.jit
def _select_kernel(
    scores_ptr,
    counts_ptr,
    out_ptr,
    k,
    stride_s,
    stride_o,
    BLOCK: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    count = tl.load(counts_ptr + row)
    want = tl.minimum(count, k)
    base = scores_ptr + row * stride_s
    digits = tl.arange(0, 256)
    # the ``want``-th largest key, a byte at a time from the highest: ``prefix`` holds the bytes
    # found, ``left`` how many of the top ``want`` are among the keys that start with it
    prefix = tl.zeros([], dtype=tl.int64)
    left = want
    for byte in range(4):
        shift = 24 - 8 * byte
        hist = tl.zeros([256], dtype=tl.int32)
        for first in range(0, count, BLOCK):
            cols = first + tl.arange(0, BLOCK)
            valid = cols < count
            key = tl.load(base + cols, mask=valid, other=0).to(tl.int64) + 2147483648
            match = valid & ((key >> (shift + 8)) == prefix)
            hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=match)
        # keys at this byte or above, for each byte value (non-increasing in it)
        at_or_above = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist
        chosen = tl.sum((at_or_above >= left).to(tl.int32), axis=0) - 1
        left -= tl.sum(tl.where(digits > chosen, hist, 0), axis=0)
        prefix = prefix * 256 + chosen
    greater = tl.zeros([], dtype=tl.int32)
    for first in range(0, count, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        valid = cols < count
        key = tl.load(base + cols, mask=valid, other=0).to(tl.int64) + 2147483648
        greater += tl.sum((valid & (key > prefix)).to(tl.int32), axis=0)
    ties = want - greater  # the tied entries to take, the lowest indices first
    tied_before = tl.zeros([], dtype=tl.int32)
    written = tl.zeros([], dtype=tl.int32)
    for first in range(0, count, BLOCK):
        cols = first + tl.arange(0, BLOCK)
        valid = cols < count
        key = tl.load(base + cols, mask=valid, other=0).to(tl.int64) + 2147483648
        tied = (valid & (key == prefix)).to(tl.int32)
        chosen_here = (valid & (key > prefix)) | (
            (tied != 0) & (tl.cumsum(tied, axis=0) + tied_before <= ties)
        )
        slot = written + tl.cumsum(chosen_here.to(tl.int32), axis=0) - 1
        tl.store(out_ptr + row * stride_o + slot, cols, mask=chosen_here)
        tied_before += tl.sum(tied, axis=0)
        written += tl.sum(chosen_here.to(tl.int32), axis=0)
    for first in range(0, k, BLOCK_K):
        slots = first + tl.arange(0, BLOCK_K)
        tl.store(
            out_ptr + row * stride_o + slots,
            tl.full([BLOCK_K], -1, tl.int32),
            mask=(slots >= written) & (slots < k),
        )


def indexer_scores_triton(
    q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, starts: torch.Tensor, counts: torch.Tensor,
    width: int, scale: float,
) -> torch.Tensor:  # fmt: skip
    """``[T, width]`` int32 (``width``: at least every count): row ``t``'s scores over
    ``keys[starts[t] : starts[t] + counts[t]]`` as :func:`order_keys` of the float32 scores
    (columns past its count unwritten)."""
    tokens, heads, dim = q.shape
    scores = torch.empty(tokens, width, dtype=torch.int32, device=q.device)
    if tokens == 0 or width == 0:
        return scores
    if q.stride(-1) != 1:
        q = q.contiguous()
    weights, keys = weights.float().contiguous(), keys.contiguous()
    dot_dtype, precision = dot_operands(q.dtype, q.device)
    with on_device(q.device):
        _indexer_scores_kernel[(tokens, triton.cdiv(width, BLOCK_E))](
            q, weights, keys, starts, counts, scores, scale, heads, dim,
            q.stride(0), q.stride(1), weights.stride(0), keys.stride(0), scores.stride(0),
            BLOCK_H=max(16, triton.next_power_of_2(heads)),
            BLOCK_E=BLOCK_E,
            BLOCK_D=max(16, triton.next_power_of_2(dim)),
            DOT_DTYPE=dot_dtype,
            DOT_PRECISION=precision,
        )  # fmt: skip
    return scores


def order_keys(scores: torch.Tensor) -> torch.Tensor:
    """float32 scores -> int32 keys that order as they do (``-0.0`` the key of ``0.0``): what
    the score kernel writes."""
    bits = torch.where(scores == 0, 0.0, scores.float()).view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


def select_topk_triton(scores: torch.Tensor, counts: torch.Tensor, k: int) -> torch.Tensor:
    """``scores [T, W]`` as :func:`order_keys` (row ``t``'s first ``counts[t]`` columns) ->
    ``[T, k]`` int32 entry indices, ascending, ``-1`` after them: the top ``k``, ties to the
    lowest index."""
    out = torch.empty(scores.shape[0], k, dtype=torch.int32, device=scores.device)
    if scores.shape[0] == 0 or k == 0:
        return out
    with on_device(scores.device):
        _select_kernel[(scores.shape[0],)](
            scores, counts, out, k, scores.stride(0), out.stride(0),
            BLOCK=BLOCK_SELECT, BLOCK_K=min(BLOCK_SELECT, triton.next_power_of_2(k)),
        )  # fmt: skip
    return out


def indexer_topk_triton(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    max_count: int,
    k: int,
    scale: float,
) -> torch.Tensor:
    """As ``indexer_topk_torch``: ``[T, k]`` int32, each row's top ``k`` entries ascending (no
    device value read on the host)."""
    tokens = q.shape[0]
    out = torch.full((tokens, k), -1, dtype=torch.int32, device=q.device)
    if tokens == 0 or k == 0:
        return out
    starts, counts = starts.to(torch.int32).contiguous(), counts.to(torch.int32).contiguous()
    width = max(max_count, 1)
    step = max(1, SCORE_BUFFER_BYTES // (4 * width))
    for first in range(0, tokens, step):
        rows = slice(first, first + step)
        scores = indexer_scores_triton(q[rows], weights[rows], keys, starts[rows], counts[rows], width, scale)
        out[rows] = select_topk_triton(scores, counts[rows], k)
    return out
