"""A DeepSeek-V4 request's state cut into pages and rebuilt (``model/v4/pages.py``): the rebuilt
state at every page boundary is the state computing the prefix leaves, and going on from it
gives the same logits. The running request's entries are made in its pages, the state computed
again keeps them in tensors of its own: the two agree. Computed a token a call (the same
arithmetic for every row, whatever the boundary), the two are equal bit for bit; computed in
chunks of 7 that straddle the boundaries (a row's products then come from matrices of other
shapes), to float32 rounding. With a sliding window shorter than a page and longer than one
(its rows then come from two pages)."""

from __future__ import annotations

import copy
import random
from pathlib import Path

import pytest
import torch

from tandem.model.v4.attention import LayerState
from tandem.model.v4.compressor import CompressorState
from tandem.model.v4.kv_layout import window_reach
from tandem.model.v4.model import DeepseekV4
from tandem.model.v4.pages import bind_pages, keep_pages, restore, store_pages, v4_pool
from tests.hf_v4_reference import tandem_v4, write_tiny_v4

PAGE = 16
TOKENS = [random.Random(7).randrange(256) for _ in range(120)]


def _run(model: DeepseekV4, layers: list[LayerState], ids: list[int], start: int, chunk: int) -> torch.Tensor:
    out = []
    for at in range(0, len(ids), chunk):
        part = ids[at : at + chunk]
        positions = torch.arange(start + at, start + at + len(part))
        out.append(model.compute_logits(model(torch.tensor(part), positions, [len(part)], [layers])))
    return torch.cat(out)


def _same(x: torch.Tensor, y: torch.Tensor, exact: bool) -> None:
    if exact:
        assert torch.equal(x, y)
    else:
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def _same_compressor(a: CompressorState, b: CompressorState, exact: bool) -> None:
    assert a.count == b.count
    assert b.pages is None and (a.pages is not None or not a.count)  # in pages; in its own tensors
    cpu = torch.device("cpu")
    _same(a.so_far(0, torch.float32, cpu), b.so_far(0, torch.float32, cpu), exact)
    for name in ("overlap_kv", "overlap_gate"):
        x, y = getattr(a, name), getattr(b, name)
        assert (x is None) == (y is None), name
        if x is not None:
            _same(x, y, exact)
    for name in ("buffer_kv", "buffer_gate"):  # no open window at a page boundary
        x = getattr(a, name)
        assert x is None or x.shape[0] == 0, name


@pytest.mark.parametrize(("window", "chunk"), [(8, 7), (24, 1)])
def test_a_state_rebuilt_from_pages_is_the_computed_one(tmp_path: Path, window: int, chunk: int) -> None:
    cfg, tensors = write_tiny_v4(tmp_path / "model", seed=3, index_topk=3, sliding_window=window)
    model = tandem_v4(cfg, tensors)
    layers = model.new_state()
    keep_pages(layers, PAGE)
    pool = v4_pool(cfg, 16, PAGE, model.dtype, window_share=1.0)  # the window's slot: the page id
    page_ids = tuple(range(15, 15 - len(TOKENS) // PAGE - 1, -1))  # any ids, not in order
    bind_pages(cfg, layers, pool, page_ids)  # its entries and keys made in its pages
    pages: list[int] = []
    exact = chunk == 1
    for at in range(0, len(TOKENS), chunk):  # pages written as the prefill completes them
        part = TOKENS[at : at + chunk]
        model(torch.tensor(part), torch.arange(at, at + len(part)), [len(part)], [layers])
        pages += store_pages(cfg, layers, at, at + len(part), pool, page_ids, lambda page: page)
    assert pages == list(page_ids[: len(TOKENS) // PAGE])
    computed = model.new_state()  # the prefix computed again, stopping at every boundary
    for k in range(1, len(pages) + 1):
        boundary = k * PAGE
        _run(model, computed, TOKENS[boundary - PAGE : boundary], boundary - PAGE, chunk)
        rebuilt = restore(cfg, pool, pages[:k], pages[max(k - window_reach(cfg, PAGE), 0) : k])
        for a, b in zip(rebuilt, computed, strict=True):
            assert a.window is not None and b.window is not None
            _same(a.window, b.window, exact)
            _same_compressor(a.compressor, b.compressor, exact)
            _same_compressor(a.indexer, b.indexer, exact)
        rest = [*TOKENS[boundary:], 3, 5, 7][:20]
        bind_pages(cfg, rebuilt, pool, (*pages[:k], 0, 1))  # going on in pages no prefix uses
        going_on = _run(model, copy.deepcopy(computed), rest, boundary, 5)
        _same(_run(model, rebuilt, rest, boundary, 5), going_on, exact)


def test_a_requests_entries_grow_in_place_with_doubling_capacity() -> None:
    """Appending a window's entry copies that entry only: the storage is reallocated a
    logarithmic number of times, and the entries are the ones appended, in order."""
    state = CompressorState()
    appended, storages = [], set()
    for i in range(1000):
        new = torch.full((1 + i % 3, 4), float(i))
        appended.append(new)
        state.append(new)
        assert state.storage is not None
        storages.add(state.storage.data_ptr())
    assert state.entries is not None and torch.equal(state.entries, torch.cat(appended))
    assert len(storages) <= 9  # 16, 32, ..., 2048 rows for 1,999 entries
