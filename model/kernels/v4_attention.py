"""DeepSeek-V4's hot attention operations, the torch references (``model/v4`` calls them through
the kernel backend; the Triton kernels in ``v4_*_triton.py`` are checked against these).

- :func:`sparse_attention_torch`: every query row attends to the keys its index list names (K = V,
  one KV head shared by every query head) with a per-head sink logit in the softmax. V4's
  sliding window and the compressed entries a query may see (CSA's picks, HCA's complete windows)
  are both index lists into one buffer of the step's keys, so one call serves every layer kind,
  prefill chunks and decode rows together.
- :func:`indexer_topk_torch`: CSA's lightning indexer, ``score(t, e) = sum_h w_{t,h} ReLU(q_{t,h} .
  k_e) * scale`` over a row's visible entries, and the top ``k`` of them, **exact ties to the lowest
  entry index** (``model/v4/indexer.py`` says why), returned as a set in ascending order.
- :func:`compress_windows_torch`: a compressor's complete windows to entries (the gated pool over
  each window's slots, then the RMSNorm).
"""

from __future__ import annotations

import torch

REFERENCE_CHUNK_BYTES = 256 << 20  # the indexer reference's gathered keys and scores, a chunk


def sparse_attention_torch(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float
) -> torch.Tensor:
    """``q [T, H, D]``, ``kv [N, D]``, ``indices [T, K]`` (rows of ``kv``; ``-1``: none), ``sink
    [H]`` float32 -> ``[T, H, D]`` in ``q``'s dtype: ``softmax([q.k_j * scale ..., sink]) . k_j``
    over row ``t``'s keys ``j`` (the sink takes probability and adds nothing). Logits and the
    softmax in float32, the probabilities rounded to ``kv``'s dtype before they weigh the keys."""
    t, heads = q.shape[0], q.shape[1]
    valid = indices >= 0
    keys = kv[indices.clamp_min(0).long()]  # [T, K, D]
    logits = torch.einsum("thd,tkd->thk", q.float(), keys.float()) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sinks = sink.float().view(1, heads, 1).expand(t, heads, 1)
    probs = torch.softmax(torch.cat([logits, sinks], dim=-1), dim=-1)[..., :-1].to(kv.dtype)
    return torch.einsum("thk,tkd->thd", probs, keys).to(q.dtype)


def top_entries(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """``scores [n, E]`` and ``visible [n, E]`` -> ``[n, min(k, E)]`` entry indices, the highest
    scores first and the lowest index among equal ones; ``-1`` where fewer than ``k`` entries
    are visible. (``-0.0`` equals ``0.0``: a sort compares values.)"""
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, : min(k, scores.shape[-1])]
    return torch.where(visible.gather(1, order), order, torch.full_like(order, -1))


def ascending(chosen: torch.Tensor) -> torch.Tensor:
    """Entry indices ``[n, k]`` (``-1``: none) sorted ascending, the ``-1`` last."""
    big = torch.iinfo(chosen.dtype).max
    order = torch.where(chosen >= 0, chosen, big).sort(dim=-1).values
    return torch.where(order == big, -1, order)


def indexer_topk_torch(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    starts: torch.Tensor,
    counts: torch.Tensor,
    max_count: int,
    k: int,
    scale: float,
) -> torch.Tensor:
    """``q [T, H, d]``, ``weights [T, H]`` float32 and the step's indexer keys ``keys [N, d]``;
    row ``t``'s visible entries are ``keys[starts[t] : starts[t] + counts[t]]`` (the rows of one
    request are consecutive and share a start; ``max_count`` is the largest count). -> ``[T, k]``
    int32: each row's top ``k`` entry indices (relative to its start) in ascending order, ``-1``
    after them when it sees fewer. Nothing is read from the device on the host."""
    tokens, heads = q.shape[0], q.shape[1]
    out = torch.full((tokens, k), -1, dtype=torch.int32, device=q.device)
    if tokens == 0 or k == 0 or max_count == 0:
        return out
    width = max_count
    entries = torch.arange(width, device=q.device)
    # rows a chunk at a time, sized on the host: each row's keys gathered ``[rows, width, d]``
    step = max(1, REFERENCE_CHUNK_BYTES // (4 * width * (heads + q.shape[2])))
    for first in range(0, tokens, step):
        rows = slice(first, first + step)
        at = (starts[rows].long()[:, None] + entries[None, :]).clamp(max=keys.shape[0] - 1)
        scores = torch.relu(torch.einsum("thd,twd->thw", q[rows].float(), keys[at].float())) * scale
        total = (scores * weights[rows].float().unsqueeze(-1)).sum(dim=1)
        chosen = ascending(top_entries(total, entries[None, :] < counts[rows, None], k))
        out[rows, : chosen.shape[1]] = chosen.to(torch.int32)
    return out


def compress_windows_torch(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    overlap: bool,
    prev_kv: torch.Tensor | None,
    prev_gate: torch.Tensor | None,
) -> torch.Tensor:
    """Complete windows' projections ``kv, gate [W, r, width]`` (float32) -> their entries
    ``[W, dim]`` (float32): ``gate + ape`` softmaxed over each window's slots per feature, the
    weighted sum of the slots' KV, RMSNorm'd with ``norm``.

    With ``overlap`` (``width = 2 * dim``) entry ``w``'s ``2r`` slots are window ``w - 1``'s
    first halves (``Ca``; for ``w = 0`` the previous call's ``prev_kv, prev_gate [r, dim]``, or
    none: weight 0) then window ``w``'s second halves (``Cb``); without it, window ``w``'s ``r``
    rows."""
    gate = gate + ape
    if overlap:
        d, r, w = kv.shape[-1] // 2, kv.shape[1], kv.shape[0]
        slots_kv = kv.new_zeros(w, 2 * r, d)
        slots_gate = gate.new_full((w, 2 * r, d), float("-inf"))
        slots_kv[:, r:], slots_gate[:, r:] = kv[..., d:], gate[..., d:]
        slots_kv[1:, :r], slots_gate[1:, :r] = kv[:-1, :, :d], gate[:-1, :, :d]
        if prev_kv is not None and prev_gate is not None:
            slots_kv[0, :r], slots_gate[0, :r] = prev_kv, prev_gate
        kv, gate = slots_kv, slots_gate
    pooled = (kv * gate.softmax(dim=1)).sum(dim=1)
    return pooled * torch.rsqrt(pooled.square().mean(-1, keepdim=True) + eps) * norm
