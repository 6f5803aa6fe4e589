"""Token sampling from logits: greedy, temperature, top-k, top-p, per-request seeds.

Sampled rows are processed together with row-local operations only, and the randomness is
counter-based: the Gumbel noise for vocabulary entry ``v`` of output token ``i`` of a request is a
hash of ``(seed, i, v)``. A seeded request therefore gets the same tokens in any batch and on any
rank (a prefill rank samples the first token, a decode rank the rest), with no generator state.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.wire.request_params import SamplingParams

_MASK64 = (1 << 64) - 1


def _to_int64(value: int) -> int:
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


_C1 = _to_int64(0x9E3779B97F4A7C15)
_C2 = _to_int64(0xBF58476D1CE4E5B9)
_C3 = _to_int64(0x94D049BB133111EB)


def _shr(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 (torch's ``>>`` is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def uniform_noise(seeds: torch.Tensor, output_indices: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[N, vocab]`` float64 uniforms in (0, 1): splitmix64 of (seed, output index, token id)."""
    token = torch.arange(vocab, dtype=torch.int64, device=seeds.device)
    x = seeds[:, None] * _C1 + (output_indices[:, None] + 1) * _C2 + token[None, :] * _C3
    x = (x ^ _shr(x, 30)) * _C2
    x = (x ^ _shr(x, 27)) * _C3
    x = x ^ _shr(x, 31)
    return (_shr(x, 11).double() + 0.5) / float(1 << 53)


def _top_p_mask(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """For logits sorted descending: True where an entry falls outside the smallest set whose
    probability mass reaches ``top_p`` (the first entry is always kept)."""
    probs = torch.softmax(sorted_logits, dim=-1)
    mass_before = torch.cumsum(probs, dim=-1) - probs
    drop = mass_before >= top_p[:, None]
    drop[:, 0] = False
    return drop


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p, row by row of ``logits [N, vocab]`` (float32)."""
    vocab = logits.shape[-1]
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
    rows = logits / temps[:, None]
    ks = [p.top_k if 0 < p.top_k < vocab else 0 for p in params]
    if any(ks):
        k = torch.tensor(ks, device=device)
        top = torch.topk(rows, max(ks), dim=-1).values
        kth = top.gather(1, (k.clamp_min(1) - 1)[:, None])
        rows = rows.masked_fill((k[:, None] > 0) & (rows < kth), float("-inf"))
    if any(p.top_p < 1.0 for p in params):
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device)
        if all(ks):  # only the top-k candidates can survive: sort those alone
            values, order = torch.topk(rows, max(ks), dim=-1)
        else:
            values, order = torch.sort(rows, dim=-1, descending=True)
        drop = _top_p_mask(values, top_p)
        mask = torch.zeros_like(rows, dtype=torch.bool).scatter_(1, order, drop)
        rows = rows.masked_fill(mask, float("-inf"))
    return rows


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    output_indices: Sequence[int],
) -> list[int]:
    """One token per row of ``logits [N, vocab]``."""
    logits = logits.float()
    tokens = torch.argmax(logits, dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        device = logits.device
        index = torch.tensor(rows, device=device)
        filtered = filter_logits(logits[index], [params[i] for i in rows])
        u = uniform_noise(
            torch.tensor([seeds[i] for i in rows], dtype=torch.int64, device=device),
            torch.tensor([output_indices[i] for i in rows], dtype=torch.int64, device=device),
            logits.shape[-1],
        )
        # Gumbel-max: argmax(logits + Gumbel noise) draws from softmax(logits)
        gumbel = -torch.log(-torch.log(u))
        tokens[index] = torch.argmax(filtered.double() + gumbel, dim=-1)
    return tokens.tolist()
