"""The kinds of state a rank's KV pool keeps on every page (torch-free).

A kind is kept by some of the model's layers, ``rows`` rows of ``dim`` numbers a page and a
layer; the pool holds each kind as one tensor ``[layers, pages, rows, dim]``, so one page of one
layer of one kind is a contiguous run of bytes (what KV transfer and the tiers move). Every kind
has a page for every page id: a page id names the same tokens' state in every kind.

DeepSeek-V3 keeps one kind, its latent (``latent_kinds``); DeepSeek-V4 several
(``model/v4/kv_layout.v4_page_kinds``)."""

from __future__ import annotations

from dataclasses import dataclass

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class PageKind:
    name: str
    layers: tuple[int, ...]  # the model's layers that keep it, in order
    rows: int  # rows one page of one layer holds
    dim: int  # numbers a row
    float32: bool = False  # float32 whatever the model's dtype (a compressor's projections)

    def page_bytes(self, item_bytes: int) -> int:
        """One page of every layer that keeps it, in a model of ``item_bytes`` a number."""
        return len(self.layers) * self.rows * self.dim * (FLOAT32_BYTES if self.float32 else item_bytes)


def latent_kinds(num_layers: int, page_size: int, kv_cache_dim: int) -> list[PageKind]:
    """DeepSeek-V3's one kind: each token's latent ``[c | k_pe]`` in every layer (the MTP
    layer's too when ``num_layers`` counts it)."""
    return [PageKind("latent", tuple(range(num_layers)), page_size, kv_cache_dim)]


def pool_page_bytes(kinds: list[PageKind], item_bytes: int) -> int:
    """One page of every kind."""
    return sum(kind.page_bytes(item_bytes) for kind in kinds)
