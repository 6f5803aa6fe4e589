"""A DeepSeek-V4 request's state in the rank's KV pool page by page as it is computed, and
rebuilt from pages: what a prefix-cache hit restores.

A running request's compressed entries and indexer keys live in its pages from the start
(:func:`bind_pages`: written as the compressors make them, read from there by attention); with
prefix caching, each page it completes leaves its window KV and overlap in a slot of the pool's,
if it gets one (:func:`store_pages`; ``engine/window_slots.py``).

A page of ``page_size`` tokens (a multiple of every compression rate, so that its boundaries are
compression boundaries of every layer) keeps, per layer, in the pool's kinds
(``model/v4/kv_layout.v4_page_kinds``): its tokens' ``window`` KV (``head_dim`` numbers a token,
K = V); on compressed layers the entries of its windows (``compressed.R``, ``page_size / R`` of
them); on CSA layers the indexer's keys and the ``overlap``: the compressor's and the indexer's
``Ca`` projections (KV and gate) of its last window, which the next page's first entries gate
over. At a page boundary no compressor holds an open window, so the state after ``k`` whole pages
is a function of those pages alone: the window is the last ``sliding_window - 1`` rows of their
KV, the entries are theirs in order, the overlap is the last page's. :func:`restore` rebuilds
exactly the state that computing the prefix leaves (``tests/model/v4/test_v4_pages.py``
compares them tensor for tensor)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch

from tandem.kvtransfer.regions import TransferLayout
from tandem.model.kv_pool import KVPool
from tandem.model.v4.attention import LayerState
from tandem.model.v4.compressor import CompressorState, PagedRows
from tandem.model.v4.config import CSA, V4Config
from tandem.model.v4.kv_layout import WINDOW_SHARE, v4_page_kinds, window_reach
from tandem.model.v4.state_slots import StateSlots


def v4_pool(
    cfg: V4Config,
    num_pages: int,
    page_size: int,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    prefix_caching: bool = True,
    window_share: float = WINDOW_SHARE,
) -> KVPool:
    """A rank's KV pool of V4's kinds (``page_size`` a multiple of every compression rate); with
    ``prefix_caching``, the kinds only hits read too (window KV and overlap, in slots for
    ``window_share`` of the pages)."""
    kinds = v4_page_kinds(cfg, page_size, prefix_caching, window_share)
    return KVPool(None, num_pages, page_size, dtype, device, kinds=kinds)


def transfer_layout(pool: KVPool, slots: StateSlots) -> TransferLayout:
    """What a transfer of a V4 request writes (``kvtransfer/regions.py``): each layer's pages of
    the kinds a running request reads (its compressed entries, its indexer keys; not the window
    KV and overlap only prefix-cache hits read) and its slot of bounded state (with the MTP
    layer's, a last layer of slot alone)."""
    reads = [
        kind.name for kind in pool.kinds if kind.name.startswith("compressed.") or kind.name == "indexer_keys"
    ]
    regions = (*pool.regions(reads), slots.region())
    device = slots.data.device
    mem_type = "VRAM" if device.type == "cuda" else "DRAM"
    return TransferLayout(regions, slots.num_layers, pool.page_size, mem_type, device.index or 0)


def snapshot(layers: list[LayerState]) -> list[LayerState]:
    """A request's state as it is now, to go back to: its fields (a state's tensors are replaced
    or appended past their rows as it moves on, never written over)."""
    return [
        replace(
            state,
            compressor=replace(state.compressor, boundary_overlaps=dict(state.compressor.boundary_overlaps)),
            indexer=replace(state.indexer, boundary_overlaps=dict(state.indexer.boundary_overlaps)),
        )
        for state in layers
    ]


def keep_pages(layers: list[LayerState], page_size: int) -> None:
    """Record from now on what pages need (a state fresh or rebuilt at a page boundary)."""
    for state in layers:
        state.keep_pages = True
        state.compressor.page_size = state.indexer.page_size = page_size


def open_rows(state: LayerState, rows: int) -> torch.Tensor | None:
    """The window KV of a state's open page (its last ``rows`` tokens) from its window, which
    keeps the last ``sliding_window - 1``: a request taken on mid-page (a transfer's slot) goes
    on keeping its pages. Rows older than the window are zeros: a hit never reads them (it
    restores the last ``sliding_window - 1`` rows before a later boundary, all kept)."""
    if not rows:
        return None
    assert state.window is not None
    have = state.window[-rows:]
    if have.shape[0] == rows:
        return have.clone()
    return torch.cat([have.new_zeros(rows - have.shape[0], have.shape[1]), have])


def bind_pages(cfg: V4Config, layers: list[LayerState], pool: KVPool, page_ids: tuple[int, ...]) -> None:
    """Put a request's compressed entries and indexer keys in its pages of ``pool`` (``page_ids``:
    its pages from its first token, as many as its tokens so far and this step's need): they are
    written there as they are made and read from there. A state's entries are bound before its
    first is made (a fresh state, or one restored from pages)."""
    for index, state in enumerate(layers):
        rate = cfg.compress_rate(index)
        if not rate:
            continue
        pairs = [(state.compressor, f"compressed.{rate}")]
        if cfg.layer_types[index] == CSA:
            pairs.append((state.indexer, "indexer_keys"))
        for compressor, kind in pairs:
            if compressor.entries is not None and compressor.count:
                raise ValueError("a state's entries already made in its own tensors cannot move to pages")
            compressor.pages = PagedRows(pool.kind(kind, index), page_ids)


def store_pages(
    cfg: V4Config,
    layers: list[LayerState],
    start: int,
    end: int,
    pool: KVPool,
    page_ids: tuple[int, ...],
    window_slot: Callable[[int], int | None],
) -> list[int]:
    """Complete in ``pool`` the pages a request completed as its state moved from position
    ``start`` to ``end`` (the boundaries in ``(start, end]``), at their ids in ``page_ids`` (the
    request's pages from its first token), for prefix-cache hits: their window KV and last
    window's overlap leave the state for the pool, in the slot ``window_slot(page)`` gives each
    (``None``: none; the entries are in the pages already: :func:`bind_pages`). The ids of the
    pages completed."""
    size, hd = pool.page_size, cfg.head_dim
    written: list[int] = []
    boundaries = range((start // size + 1) * size, end + 1, size)
    for boundary in boundaries:
        page = page_ids[boundary // size - 1]
        slot = window_slot(page)
        for index, state in enumerate(layers):
            assert state.open_page is not None and state.open_page.shape[0] >= size
            if slot is not None:
                pool.kind("window", index)[slot] = state.open_page[:size]
            state.open_page = state.open_page[size:]
            if cfg.layer_types[index] != CSA:
                continue
            assert state.compressor.pages is not None and state.indexer.pages is not None
            for at, compressor in ((0, state.compressor), (2 * hd, state.indexer)):
                kv, gate = compressor.boundary_overlaps.pop(boundary)
                if slot is not None:
                    overlap, width = pool.kind("overlap", index)[slot], kv.shape[1]
                    overlap[:, at : at + width] = kv
                    overlap[:, at + width : at + 2 * width] = gate
        written.append(page)
    if boundaries:  # the open page's rows alone, not the base the completed pages were cut from
        for state in layers:
            assert state.open_page is not None
            state.open_page = state.open_page.clone()
    return written


def restore(cfg: V4Config, pool: KVPool, page_ids: list[int], window_slots: list[int]) -> list[LayerState]:
    """The state after the pages ``page_ids`` (``len(page_ids)`` whole pages, their tokens
    computed in order), ready to go on from there and to keep its next pages; ``window_slots``:
    the slots holding the window KV and overlap of the last :func:`window_reach` of them (fewer
    when the prefix is shorter)."""
    if not page_ids:
        raise ValueError("a state is restored from one page or more")
    size, hd = pool.page_size, cfg.head_dim
    position = len(page_ids) * size
    keep = cfg.sliding_window - 1
    window = pool.tensors["window"]
    if len(window_slots) != min(window_reach(cfg, size), len(page_ids)):
        raise ValueError(
            f"{len(window_slots)} window slots for a window over the last {window_reach(cfg, size)} pages"
        )
    tail = torch.tensor(window_slots, dtype=torch.int64, device=window.device)
    layers = []
    for index in range(cfg.num_hidden_layers):
        state = LayerState()
        rows = pool.kind("window", index)[tail].reshape(-1, hd)
        state.window = rows[max(rows.shape[0] - keep, 0) :]
        rate = cfg.compress_rate(index)
        if rate:
            count = position // rate
            if cfg.layer_types[index] == CSA:
                overlap = pool.kind("overlap", index)[window_slots[-1]]
                state.compressor = _restored(overlap[:, : 2 * hd], count)
                state.indexer = _restored(overlap[:, 2 * hd :], count)
            else:
                state.compressor = CompressorState(count=count)
        layers.append(state)
    bind_pages(cfg, layers, pool, tuple(page_ids))
    keep_pages(layers, size)
    return layers


def _restored(overlap: torch.Tensor, count: int) -> CompressorState:
    """A compressor's state at a page boundary, its entries in their pages: their count and its
    last window's ``Ca`` (``overlap``: ``[rate, kv | gate]``)."""
    width = overlap.shape[1] // 2
    kv, gate = overlap[:, :width].clone(), overlap[:, width:].clone()
    return CompressorState(overlap_kv=kv, overlap_gate=gate, count=count)
