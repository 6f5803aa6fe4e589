"""Absorbed (latent-space) MLA decode equals the plain form on the same paged pool."""

from __future__ import annotations

import pytest
import torch

from tandem.model.attention_metadata import AttentionMetadata
from tandem.model.kernels.mla_attention import decode_attention_torch, extend_attention_torch, kv_store_torch


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_absorbed_decode_equals_plain(dtype: torch.dtype, tol: float) -> None:
    gen = torch.Generator().manual_seed(0)
    heads, nope, rope, v, latent, page = 4, 16, 8, 12, 32, 8
    seq_lens = [1, page, page + 1, 50]
    pages = [[3], [10], [0, 7], [1, 2, 4, 5, 6, 8, 9]]
    kv = torch.randn(12, page, latent + rope, generator=gen, dtype=dtype)
    w_kv_b = torch.randn(heads * (nope + v), latent, generator=gen, dtype=dtype) / latent**0.5
    q = torch.randn(len(seq_lens), heads, nope + rope, generator=gen, dtype=dtype)
    meta = AttentionMetadata.build(page, [1] * 4, seq_lens, pages)
    scale = (nope + rope) ** -0.5

    plain = extend_attention_torch(q, kv, meta, w_kv_b, heads, nope, v, scale)

    w = w_kv_b.view(heads, nope + v, latent)
    q_latent = torch.einsum("bhn,hnl->bhl", q[..., :nope], w[:, :nope])
    o_latent = decode_attention_torch(q_latent, q[..., nope:], kv, meta, scale)
    absorbed = torch.einsum("bhl,hvl->bhv", o_latent, w[:, nope:])
    assert torch.allclose(absorbed, plain, rtol=tol, atol=tol)


def test_kv_store_writes_only_the_given_slots() -> None:
    gen = torch.Generator().manual_seed(1)
    kv = torch.full((4, 4, 6), float("nan"))
    latent, k_pe = torch.randn(3, 4, generator=gen), torch.randn(3, 2, generator=gen)
    slots = torch.tensor([5, 6, 12])  # page 1 slots 1-2, page 3 slot 0
    kv_store_torch(kv, slots, latent, k_pe)
    flat = kv.view(-1, 6)
    assert torch.equal(flat[slots], torch.cat([latent, k_pe], dim=-1))
    untouched = torch.ones(16, dtype=torch.bool)
    untouched[slots] = False
    assert torch.isnan(flat[untouched]).all()


def test_empty_batch_runs_every_layer() -> None:
    """An idle rank of a DEP group runs the model on no tokens (its MoE layers still serve others)."""
    from tandem.model.config import ModelConfig
    from tandem.model.deepseek import DeepseekV3
    from tandem.model.kv_pool import KVPool
    from tandem.model.make_tiny import tiny_config_dict

    cfg = ModelConfig.from_dict(tiny_config_dict())
    model = DeepseekV3(cfg, torch.float32)
    for p in model.parameters():
        p.data.normal_()
    pool = KVPool(cfg, 4, 8, torch.float32)
    meta = AttentionMetadata.build(8, [], [], [])
    empty = torch.empty(0, dtype=torch.int64)
    hidden = model.forward(empty, empty, meta, pool)
    assert hidden.shape == (0, cfg.hidden_size)


def test_layer_hook_sees_each_layers_kv_written_before_the_next_layer() -> None:
    from tandem.model.config import ModelConfig
    from tandem.model.deepseek import DeepseekV3
    from tandem.model.kv_pool import KVPool
    from tandem.model.make_tiny import tiny_config_dict

    cfg = ModelConfig.from_dict(tiny_config_dict())
    model = DeepseekV3(cfg, torch.float32)
    for p in model.parameters():
        p.data.normal_(0, 0.1)
    pool = KVPool(cfg, 4, 8, torch.float32)
    pool.kv.fill_(float("nan"))
    meta = AttentionMetadata.build(8, [5], [5], [[2]])
    seen: list[int] = []

    def hook(layer: int) -> None:
        assert not torch.isnan(pool.kv[layer, 2, :5]).any()  # this layer's KV is written
        if layer + 1 < cfg.num_hidden_layers:
            assert torch.isnan(pool.kv[layer + 1, 2, :5]).all()  # the next one not yet
        seen.append(layer)

    model.forward(torch.arange(5), torch.arange(5), meta, pool, on_layer_kv=hook)
    assert seen == list(range(cfg.num_hidden_layers))
