"""The kinds of state a rank's KV pool keeps on every page (torch-free).

A kind is kept by some of the model's layers, ``rows`` rows of ``dim`` numbers a page and a
layer; the pool holds each kind as one tensor ``[layers, pages, rows, dim]``, so one page of one
layer of one kind is a contiguous run of bytes (what KV transfer and the tiers move). A kind
kept whole (``share`` 1) has a page for every page id: a page id names the same tokens' state in
every such kind. A kind kept for some pages only (``share`` below 1: DeepSeek-V4's window KV,
which only a prefix-cache hit's last pages need) has ``ceil(share * pages)`` slots, which its
user hands to pages (``engine/window_slots.py``); such a kind is ``in_slots`` at any share, even
1 (a slot for every page, but not the page's id).

DeepSeek-V3 keeps one kind, its latent (``latent_kinds``); DeepSeek-V4 several
(``model/v4/kv_layout.v4_page_kinds``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

FLOAT32_BYTES = 4


@dataclass(frozen=True)
class PageKind:
    name: str
    layers: tuple[int, ...]  # the model's layers that keep it, in order
    rows: int  # rows one page of one layer holds
    dim: int  # numbers a row
    float32: bool = False  # float32 whatever the model's dtype (a compressor's projections)
    share: float = 1.0  # slots a page: 1, a page for every page id; below, slots handed out
    in_slots: bool = False  # kept in slots its user hands to pages, not by page id (any share)

    def page_bytes(self, item_bytes: int) -> int:
        """One page of every layer that keeps it, in a model of ``item_bytes`` a number."""
        return len(self.layers) * self.rows * self.dim * (FLOAT32_BYTES if self.float32 else item_bytes)

    def slots(self, num_pages: int) -> int:
        """Pages of this kind a pool of ``num_pages`` pages holds."""
        return num_pages if self.share >= 1 else math.ceil(self.share * num_pages)


def latent_kinds(num_layers: int, page_size: int, kv_cache_dim: int) -> list[PageKind]:
    """DeepSeek-V3's one kind: each token's latent ``[c | k_pe]`` in every layer (the MTP
    layer's too when ``num_layers`` counts it)."""
    return [PageKind("latent", tuple(range(num_layers)), page_size, kv_cache_dim)]


def pool_page_bytes(kinds: list[PageKind], item_bytes: int) -> int:
    """One page of every kind (a kind kept in slots: its share of one)."""
    return round(sum(kind.page_bytes(item_bytes) * min(kind.share, 1.0) for kind in kinds))


def pool_bytes(kinds: list[PageKind], num_pages: int, item_bytes: int) -> int:
    """A pool of ``num_pages`` pages: every kind's pages or slots."""
    return sum(kind.page_bytes(item_bytes) * kind.slots(num_pages) for kind in kinds)
