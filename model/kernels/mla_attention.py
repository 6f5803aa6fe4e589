"""MLA attention over the paged latent KV pool (torch references).

One layer's pool is ``kv_layer [num_pages, page_size, L + R]``: per token the normalised latent
``c`` (``L = kv_lora_rank``) followed by the rotated rope key (``R = qk_rope_head_dim``).

- extend (plain form): the request's latents are expanded with ``kv_b_proj`` into per-head keys
  and values, and its new tokens attend causally to the prefix and to themselves.
- decode (absorbed form): the query is projected into the latent space, so attention runs
  directly over ``c``; the output stays in the latent space and is projected to ``v`` after.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tandem.model.attention_metadata import AttentionMetadata


def kv_store_torch(
    kv_layer: torch.Tensor, slot_mapping: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor
) -> None:
    flat = kv_layer.view(-1, kv_layer.shape[-1])
    rows = torch.cat([latent, k_pe], dim=-1).to(kv_layer.dtype)
    keep = slot_mapping >= 0  # a negative slot is a padding row: it writes nothing
    flat[slot_mapping[keep]] = rows[keep]


def gather_kv(kv_layer: torch.Tensor, meta: AttentionMetadata, row: int) -> torch.Tensor:
    """The pool entries ``[seq_len, L + R]`` of one request, in position order."""
    seq_len = meta.seq_lens[row]
    pages = meta.page_table[row, : -(-seq_len // meta.page_size)]
    return kv_layer[pages].reshape(-1, kv_layer.shape[-1])[:seq_len]


def _acc(dtype: torch.dtype) -> torch.dtype:
    """Scores, softmax and the weighted sum accumulate in float32 (float64 for float64 inputs)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def extend_attention_torch(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    w_kv_b: torch.Tensor,
    num_heads: int,
    qk_nope_head_dim: int,
    v_head_dim: int,
    scale: float,
) -> torch.Tensor:
    latent_dim = w_kv_b.shape[1]
    out = q.new_empty((q.shape[0], num_heads, v_head_dim))
    for row, (start, n) in enumerate(zip(meta.query_start.tolist(), meta.query_lens, strict=False)):
        kv = gather_kv(kv_layer, meta, row)
        seq_len = kv.shape[0]
        kv_expanded = F.linear(kv[:, :latent_dim], w_kv_b).view(seq_len, num_heads, -1)
        k_nope, v = kv_expanded.split([qk_nope_head_dim, v_head_dim], dim=-1)
        k_pe = kv[:, latent_dim:][:, None, :].expand(-1, num_heads, -1)
        k = torch.cat([k_nope, k_pe], dim=-1)  # [S, H, nope+R]
        acc = _acc(q.dtype)
        qr = q[start : start + n].to(acc)  # [n, H, nope+R]
        scores = torch.einsum("nhd,shd->hns", qr, k.to(acc)) * scale
        q_pos = torch.arange(seq_len - n, seq_len, device=q.device)[:, None]
        k_pos = torch.arange(seq_len, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start : start + n] = torch.einsum("hns,shd->nhd", probs, v.to(acc)).to(out.dtype)
    return out


def decode_attention_torch(
    q_latent: torch.Tensor,
    q_pe: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    latent_dim = q_latent.shape[-1]
    acc = _acc(q_latent.dtype)
    out = torch.empty_like(q_latent)
    for row in range(len(meta.seq_lens)):
        kv = gather_kv(kv_layer, meta, row).to(acc)
        c, k_pe = kv[:, :latent_dim], kv[:, latent_dim:]
        scores = (q_latent[row].to(acc) @ c.T + q_pe[row].to(acc) @ k_pe.T) * scale
        out[row] = (torch.softmax(scores, dim=-1) @ c).to(out.dtype)
    return out
