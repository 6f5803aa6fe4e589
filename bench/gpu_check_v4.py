"""``gpu_check``'s DeepSeek-V4 rows: the sparse attention with sinks, the indexer (scores and
stable top-k) and the compressor's pool, each Triton kernel against its torch reference and
timed as a fraction of its roofline, at DeepSeek-V4-Flash shapes (one rank of a DEP group: all 64
query heads of 512, K = V; a sliding window of 128 and CSA's top 512 of the entries; the
indexer's 64 heads of 128; CSA 4:1 with overlap, HCA 128:1), over a 32K-token context.

Index lists are what a step builds: per request its window's 128 keys then 512 distinct
compressed entries, in a key buffer of every request's keys. The indexer's picks are compared as
sets: the error cell is the fraction of picked entries that differ (two float32 sums in
different orders can round a near-tie across the k-th score)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from tandem.model.kernels.backend import KernelBackend


class _Checks(Protocol):
    """What these rows use of ``gpu_check``'s run: its inputs and its ``add``."""

    device: torch.device
    gen: torch.Generator
    item: int
    tri: KernelBackend

    def rand(self, *shape: int, std: float = 1.0) -> torch.Tensor: ...

    def add(
        self,
        name: str,
        shape: str,
        out: Any,
        ref: Any,
        fn: Callable[[], Any],
        nbytes: float = 0.0,
        flops: float = 0.0,
        target: float | None = None,
        err: float | None = None,
    ) -> None: ...


@dataclass(frozen=True)
class V4Shapes:
    heads: int = 64
    head_dim: int = 512
    window: int = 128
    topk: int = 512
    index_heads: int = 64
    index_dim: int = 128
    context: int = 32768
    csa_rate: int = 4
    hca_rate: int = 128
    decode_batch: int = 64
    prefill_tokens: int = 2048


V4_FLASH = V4Shapes()
V4_TINY = V4Shapes(
    heads=4, head_dim=32, window=8, topk=6, index_heads=2, index_dim=16, context=96, csa_rate=4, hca_rate=16,
    decode_batch=3, prefill_tokens=24,
)  # fmt: skip


def check_v4(c: _Checks, v: V4Shapes) -> None:
    _check_sparse_attention(c, v)
    _check_indexer(c, v)
    _check_compress(c, v)


def _sparse_indices(
    v: V4Shapes, rows_per_request: list[int], gen: torch.Generator
) -> tuple[torch.Tensor, int]:
    """``[T, window + topk]`` lists into a buffer of every request's window then entries."""
    entries = v.context // v.csa_rate
    lists, base = [], 0
    for rows in rows_per_request:
        window = base + torch.arange(v.window)
        for _ in range(rows):
            picked = base + v.window + torch.randperm(entries, generator=gen)[: v.topk]
            lists.append(torch.cat([window, picked.sort().values]))
        base += v.window + entries
    return torch.stack(lists).to(torch.int32), base


def _check_sparse_attention(c: _Checks, v: V4Shapes) -> None:
    from tandem.model.kernels.v4_attention import sparse_attention_torch

    width = v.window + v.topk
    for name, requests in (
        ("v4_sparse_attention_decode", [1] * v.decode_batch),
        ("v4_sparse_attention_prefill", [v.prefill_tokens]),
    ):
        indices, keys = _sparse_indices(v, requests, c.gen)
        indices = indices.to(c.device)
        tokens = indices.shape[0]
        q, kv = c.rand(tokens, v.heads, v.head_dim), c.rand(keys, v.head_dim)
        sink = torch.randn(v.heads, generator=c.gen).to(c.device)
        scale = v.head_dim**-0.5
        # keys gathered per row (rows of one request share their window; counted once a row)
        nbytes = (
            tokens * width * v.head_dim + 2 * tokens * v.heads * v.head_dim
        ) * c.item + indices.numel() * 4
        args = (q, kv, indices, sink, scale)
        c.add(name, f"T={tokens} H={v.heads} D={v.head_dim} K={width}", c.tri.sparse_attention(*args),
              sparse_attention_torch(*args), lambda args=args: c.tri.sparse_attention(*args),  # type: ignore[misc]
              nbytes=nbytes, flops=4 * tokens * v.heads * width * v.head_dim)  # fmt: skip


def _check_indexer(c: _Checks, v: V4Shapes) -> None:
    from tandem.model.kernels.v4_attention import indexer_topk_torch

    entries = v.context // v.csa_rate
    for name, requests in (
        ("v4_indexer_topk_decode", [1] * v.decode_batch),
        ("v4_indexer_topk_prefill", [v.prefill_tokens]),
    ):
        keys = c.rand(len(requests) * entries, v.index_dim)
        starts = torch.tensor(
            [r * entries for r, n in enumerate(requests) for _ in range(n)], dtype=torch.int32
        )
        # each request's last ``n`` positions of the context: a row sees the complete windows
        positions = [v.context - n + i for n in requests for i in range(n)]
        counts = torch.tensor([(p + 1) // v.csa_rate for p in positions], dtype=torch.int32)
        starts, counts = starts.to(c.device), counts.to(c.device)
        tokens = starts.shape[0]
        q = c.rand(tokens, v.index_heads, v.index_dim)
        weights = torch.randn(tokens, v.index_heads, generator=c.gen).to(c.device)
        args = (q, weights, keys, starts, counts, entries, v.topk, v.index_dim**-0.5)
        out, ref = c.tri.indexer_topk(*args), indexer_topk_torch(*args)
        differ = sum(len(set(a) ^ set(b)) for a, b in zip(out.tolist(), ref.tolist(), strict=True)) / 2
        seen = int(counts.sum())
        # keys read a row (shared ones counted once a row), then the score keys written and read
        # by the select's six passes
        nbytes = seen * v.index_dim * c.item + 7 * seen * 4
        flops = 2 * seen * v.index_heads * v.index_dim
        c.add(name, f"T={tokens} entries={entries} H={v.index_heads} d={v.index_dim} k={v.topk}", out, ref,
              lambda args=args: c.tri.indexer_topk(*args), nbytes, flops,  # type: ignore[misc]
              err=differ / out.numel())  # fmt: skip


def _check_compress(c: _Checks, v: V4Shapes) -> None:
    from tandem.model.kernels.v4_attention import compress_windows_torch

    gen = c.gen
    for name, rate, dim, overlap in (
        ("v4_compress_csa", v.csa_rate, v.head_dim, True),
        ("v4_compress_indexer", v.csa_rate, v.index_dim, True),
        ("v4_compress_hca", v.hca_rate, v.head_dim, False),
    ):
        windows, width = v.prefill_tokens // rate, (2 if overlap else 1) * dim
        kv = torch.randn(windows, rate, width, generator=gen).to(c.device)
        gate = torch.randn(windows, rate, width, generator=gen).to(c.device)
        ape = torch.randn(rate, width, generator=gen).to(c.device)
        norm = (1 + 0.1 * torch.randn(dim, generator=gen)).to(c.device)
        prev = (kv[0, :, :dim].clone(), gate[0, :, :dim].clone()) if overlap else (None, None)
        args = (kv, gate, ape, norm, 1e-6, overlap, *prev)
        nbytes = (2 * windows * rate * width + windows * dim) * 4
        c.add(name, f"W={windows} rate={rate} dim={dim}", c.tri.compress_windows(*args),
              compress_windows_torch(*args), lambda args=args: c.tri.compress_windows(*args),  # type: ignore[misc]
              nbytes=nbytes)  # fmt: skip
