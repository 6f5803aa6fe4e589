"""Token sampling from logits: logit bias, penalties, greedy, temperature, top-k, top-p, min-p,
per-request seeds.

Sampled rows are processed together with row-local operations only, and the randomness is
counter-based: the Gumbel noise for vocabulary entry ``v`` of output token ``i`` of a request is a
hash of ``(seed, i, v)``. A seeded request therefore gets the same tokens in any batch and on any
rank (a prefill rank samples the first token, a decode rank the rest), with no generator state.
Penalties read only the request's own tokens (its prompt and its outputs so far, ``History``),
so they keep that: the same history and seed give the same token in any batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.wire.logprobs import TokenLogprobs
from tandem.wire.request_params import SamplingParams

# a sampled row's tokens so far: (prompt token ids, output token ids before the one drawn)
History = tuple[Sequence[int], Sequence[int]]

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


def apply_penalties(
    logits: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[History | None]
) -> torch.Tensor:
    """``logits [N, vocab]`` (float32) with each penalized row's penalties applied, in vLLM's
    order (``SamplingParams``): the repetition penalty over the prompt's and the outputs'
    tokens, then the frequency and presence penalties over the outputs'."""
    rows = [i for i, p in enumerate(params) if p.penalized]
    if not rows:
        return logits
    logits = logits.clone()
    vocab, device = logits.shape[-1], logits.device
    for i in rows:
        p, history = params[i], histories[i]
        if history is None:
            raise ValueError(f"row {i}: a penalized request's row needs its tokens so far")
        prompt, outputs = history
        counts = torch.bincount(torch.tensor(outputs, dtype=torch.int64, device=device), minlength=vocab)
        row = logits[i]
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            if len(prompt):
                seen[torch.tensor(prompt, dtype=torch.int64, device=device)] = True
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row = torch.where(seen, scaled, row)
        row = (
            row - p.frequency_penalty * counts.to(row.dtype) - p.presence_penalty * (counts > 0).to(row.dtype)
        )
        logits[i] = row
    return logits


def apply_logit_bias(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``logits [N, vocab]`` (float32) with each row's ``logit_bias`` added at its token ids."""
    logits = logits.clone()
    for i, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], dtype=torch.int64, device=logits.device)
            bias = torch.tensor([b for _, b in p.logit_bias], dtype=logits.dtype, device=logits.device)
            logits[i].index_add_(0, ids, bias)
    return logits


def filter_logits(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then top-k, then top-p, then min-p, row by row of ``logits [N, vocab]``
    (float32). Min-p's threshold is relative to the likeliest token, which every filter keeps, so
    it does not depend on the order."""
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
    if any(p.min_p > 0.0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device)
        # p(v) < min_p * p(max)  <=>  logit(v) < logit(max) + log(min_p)
        bound = rows.max(dim=-1, keepdim=True).values + torch.log(min_p)[:, None]
        rows = rows.masked_fill(rows < bound, float("-inf"))
    return rows


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    output_indices: Sequence[int],
    histories: Sequence[History | None] | None = None,
    allowed: tuple[Sequence[int], torch.Tensor] | None = None,
) -> list[int]:
    """One token per row of ``logits [N, vocab]``; ``histories`` (each penalized row's tokens so
    far) is needed only where a row's request has a penalty. ``allowed``: rows and their masks
    (``[len(rows), vocab]`` bool, a guide's: ``model/grammar``); a row's other tokens are
    dropped after the penalties, before the temperature and filters."""
    logits = logits.float()
    if any(p.logit_bias for p in params):
        logits = apply_logit_bias(logits, params)
    if any(p.penalized for p in params):
        logits = apply_penalties(logits, params, histories or [None] * len(params))
    if allowed is not None and len(allowed[0]):
        rows_, masks = allowed
        index = torch.tensor(list(rows_), dtype=torch.int64, device=logits.device)
        logits = logits.clone()
        logits[index] = logits[index].masked_fill(~masks.to(logits.device), float("-inf"))
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


def logprobs_of(logits: torch.Tensor, token_ids: Sequence[int], top: Sequence[int]) -> list[TokenLogprobs]:
    """Row ``i`` of ``logits [N, vocab]``: the log-softmax (float32) of the raw row at
    ``token_ids[i]``, and its ``top[i]`` likeliest entries, likeliest first. Raw: before any
    penalty, temperature or filter (``wire/logprobs``)."""
    if not len(token_ids):
        return []
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)
    chosen = logprobs.gather(1, ids[:, None]).squeeze(1).tolist()
    k = min(max(top), logits.shape[-1])
    values: list[list[float]] = [[] for _ in token_ids]
    indices: list[list[int]] = [[] for _ in token_ids]
    if k:
        found = torch.topk(logprobs, k, dim=-1)
        values, indices = found.values.tolist(), found.indices.tolist()
    return [
        TokenLogprobs(token, lp, tuple(zip(indices[i][: top[i]], values[i][: top[i]], strict=True)))
        for i, (token, lp) in enumerate(zip(token_ids, chosen, strict=True))
    ]
