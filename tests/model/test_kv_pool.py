"""The KV pool holds each kind of state a model's pages keep as one tensor (``model/kv_pool.py``):
DeepSeek-V3's latent is its one-kind case; DeepSeek-V4's pool holds exactly the bytes the memory
plan counts for its pages (with prefix caching and without), and a page copy moves every kind."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tandem.model.config import ModelConfig
from tandem.model.kv_pool import KVPool
from tandem.model.v4.config import CSA, V4Config
from tandem.model.v4.kv_layout import (
    WINDOW_SHARE,
    page_bytes,
    pages_for_bytes,
    request_bytes,
    v4_kinds,
    v4_page_size,
)
from tandem.model.v4.pages import v4_pool

MODELS = Path(__file__).resolve().parents[2] / "deploy" / "models"


def test_v3_keeps_one_kind_its_latent_in_every_layer() -> None:
    cfg = ModelConfig.from_dir(MODELS / "deepseek-v3")
    pool = KVPool(cfg, 3, 4, torch.bfloat16, num_layers=cfg.num_hidden_layers + 1)
    assert pool.names == ["latent"]
    assert pool.kv.shape == (cfg.num_hidden_layers + 1, 3, 4, cfg.kv_cache_dim)
    assert pool.layout.page_bytes == 4 * cfg.kv_cache_dim * 2


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_v4_pool_holds_what_the_plan_counts_for_its_pages(prefix_caching: bool) -> None:
    cfg = V4Config.from_dir(MODELS / "deepseek-v4-flash")
    size = v4_page_size(cfg, 64)
    kinds = v4_kinds(cfg, 2, size, prefix_caching=prefix_caching)
    budget = 64 * 2**20 + 4 * request_bytes(kinds)
    num_pages = pages_for_bytes(cfg, size, 2, budget, 4, prefix_caching=prefix_caching)
    pool = v4_pool(cfg, num_pages, size, torch.bfloat16, prefix_caching=prefix_caching)
    window_page = 43 * size * cfg.head_dim * 2  # the window's slots round up to whole ones
    assert 0 <= pool.nbytes() - num_pages * page_bytes(kinds, size) < window_page
    assert pool.nbytes() + 4 * request_bytes(kinds) <= budget
    csa = [i for i in range(cfg.num_hidden_layers) if cfg.layer_types[i] == CSA]
    assert pool.kind("compressed.4", csa[0]).shape == (num_pages, size // 4, cfg.head_dim)
    if not prefix_caching:  # what only a hit reads is not kept
        assert pool.names == ["compressed.4", "compressed.128", "indexer_keys"]
        return
    assert pool.names == ["window", "compressed.4", "compressed.128", "indexer_keys", "overlap"]
    assert pool.tensors["overlap"].dtype == torch.float32
    assert pool.tensors["window"].shape[1] == math.ceil(num_pages * WINDOW_SHARE)  # slots, not pages
    for layout in pool.layouts().values():  # each kind's page of a layer: one contiguous run
        assert layout.page_stride_bytes == layout.page_bytes


def test_a_page_copy_moves_every_kind_and_a_multi_kind_pool_has_no_single_tensor() -> None:
    cfg = V4Config.from_dir(MODELS / "deepseek-v4-flash")
    pool = v4_pool(cfg, 3, v4_page_size(cfg, 64), torch.float32, prefix_caching=False)
    for kv in pool.tensors.values():
        kv[:, 0] = torch.randn_like(kv[:, 0])
    pool.copy_pages([(0, 2)])
    for kv in pool.tensors.values():
        assert torch.equal(kv[:, 2], kv[:, 0]) and not kv[:, 1].any()
    with pytest.raises(ValueError, match="keeps 3 kinds of state: name one"):
        _ = pool.kv
    slotted = v4_pool(cfg, 3, v4_page_size(cfg, 64), torch.float32)
    before = {name: kv.clone() for name, kv in slotted.tensors.items()}
    with pytest.raises(ValueError, match=r"kinds \['window', 'overlap'\] are kept in slots"):
        slotted.copy_pages([(0, 2)])
    assert all(torch.equal(before[name], kv) for name, kv in slotted.tensors.items())  # nothing moved
