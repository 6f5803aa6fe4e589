"""Token sampling from logits: greedy, temperature, top-k, top-p, per-request seeds.

A seeded draw depends only on ``(seed, output_index)`` and the request's own logits row, never
on the batch or on earlier draws, so the same seed gives the same tokens in any batch and on any
rank (a prefill rank can sample the first token and a decode rank the rest).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.request import SamplingParams

_MIX = 0x9E3779B97F4A7C15
_MASK = (1 << 63) - 1


def draw_seed(seed: int, output_index: int) -> int:
    """A 63-bit generator seed for one draw (splitmix64 finaliser over seed and index)."""
    z = (seed * _MIX + (output_index + 1) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & ((1 << 64) - 1)
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & ((1 << 64) - 1)
    return (z ^ (z >> 31)) & _MASK


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the smallest set whose mass reaches ``top_p``)."""
    row = logits / params.temperature
    if params.top_k and params.top_k < row.shape[-1]:
        kth = torch.topk(row, params.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(row, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop = mass_before >= params.top_p
        drop[0] = False
        row = row.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    return row


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    output_indices: Sequence[int],
) -> list[int]:
    """One token per row of ``logits [N, vocab]``."""
    logits = logits.float()
    tokens = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        probs = torch.softmax(filter_logits(logits[i], p), dim=-1)
        gen = torch.Generator(device=logits.device).manual_seed(draw_seed(seeds[i], output_indices[i]))
        noise = torch.empty_like(probs).exponential_(generator=gen)
        # argmax(p / E) with E ~ Exp(1) draws index i with probability p_i (exponential race)
        tokens[i] = int(torch.argmax(probs / noise))
    return tokens
