"""A DeepSeek-V4 request's state cut into pages as it is computed, and rebuilt from pages: what a
prefix-cache hit restores.

A page of ``page_size`` tokens (a multiple of every compression rate, so that its boundaries are
compression boundaries of every layer) keeps, per layer: its tokens' window KV (``head_dim``
numbers a token, K = V); on compressed layers the entries of its windows (``page_size / rate``
of them); on CSA layers the ``Ca`` projections (KV and gate) of its last window, which the next
page's first entry gates over; the indexer's keys and ``Ca`` the same way. At a page boundary
no compressor holds an open window, so the state after ``k`` whole pages is a function of those
pages alone: the window is the last ``sliding_window - 1`` rows of their KV, the entries are
theirs in order, the overlap is the last page's. :func:`restore` rebuilds exactly the state that
computing the prefix leaves (``tests/model/v4/test_v4_pages.py`` compares them tensor for tensor)."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from tandem.model.v4.attention import LayerState
from tandem.model.v4.compressor import CompressorState
from tandem.model.v4.config import V4Config


@dataclass(frozen=True)
class CompressedPage:
    entries: torch.Tensor  # [page_size // rate, dim]
    overlap: tuple[torch.Tensor, torch.Tensor] | None  # the page's last window's Ca: (kv, gate); CSA


@dataclass(frozen=True)
class LayerPage:
    window: torch.Tensor  # [page_size, head_dim]: the page's tokens' KV
    compressor: CompressedPage | None
    indexer: CompressedPage | None


PageState = list[LayerPage]  # one a layer


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


def take_pages(
    cfg: V4Config, layers: list[LayerState], start: int, end: int, page_size: int
) -> list[PageState]:
    """The pages a request completed as its state moved from position ``start`` to ``end`` (the
    boundaries in ``(start, end]``), in order; what they keep leaves the state."""
    pages: list[PageState] = []
    for boundary in range((start // page_size + 1) * page_size, end + 1, page_size):
        page: PageState = []
        for index, state in enumerate(layers):
            assert state.open_page is not None and state.open_page.shape[0] >= page_size
            rows, state.open_page = state.open_page[:page_size], state.open_page[page_size:]
            rate = cfg.compress_rate(index)
            page.append(
                LayerPage(
                    rows.clone(),
                    _compressed(state.compressor, boundary, page_size, rate),
                    _compressed(state.indexer, boundary, page_size, rate),
                )
            )
        pages.append(page)
    return pages


def _compressed(state: CompressorState, boundary: int, page_size: int, rate: int) -> CompressedPage | None:
    if state.entries is None or not rate:  # no compressor here (or not this one: HCA's indexer)
        return None
    entries = state.entries[(boundary - page_size) // rate : boundary // rate].clone()
    return CompressedPage(entries, state.boundary_overlaps.pop(boundary, None))


def restore(cfg: V4Config, pages: list[PageState], page_size: int) -> list[LayerState]:
    """The state after the ``len(pages)`` whole pages (their tokens computed in order), ready to
    go on from there and to keep its next pages."""
    position = len(pages) * page_size
    keep = cfg.sliding_window - 1
    tail = pages[-math.ceil(keep / page_size) :] if keep else []
    layers = []
    for index in range(cfg.num_hidden_layers):
        state = LayerState()
        if tail:
            rows = torch.cat([page[index].window for page in tail])
            state.window = rows[max(rows.shape[0] - keep, 0) :]
        else:
            state.window = pages[0][index].window[:0]
        rate = cfg.compress_rate(index)
        state.compressor = _restored([page[index].compressor for page in pages], position, rate)
        state.indexer = _restored([page[index].indexer for page in pages], position, rate)
        layers.append(state)
    keep_pages(layers, page_size)
    return layers


def _restored(items: list[CompressedPage | None], position: int, rate: int) -> CompressorState:
    present = [item for item in items if item is not None]
    if not present:
        return CompressorState()
    if len(present) != len(items):
        raise ValueError("a page without the compressed state its layer keeps")
    last = present[-1].overlap
    return CompressorState(
        overlap_kv=None if last is None else last[0],
        overlap_gate=None if last is None else last[1],
        entries=torch.cat([item.entries for item in present]),
        count=position // rate,
    )
