"""The Triton KV scatter against ``kv_store_torch`` (Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from tandem.model.kernels.kv_store_triton import kv_store_triton
from tandem.model.kernels.mla_attention import kv_store_torch
from tests.model.kernels.test_mla_decode import DEEPSEEK_LATENT, DEEPSEEK_ROPE, sm90_resources

LATENT, ROPE, PAGE, NUM_PAGES = 32, 8, 4, 9


def _inputs(
    num_tokens: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Distinct random slots over shuffled pages, and latent / k_pe as strided views of one row."""
    gen = torch.Generator().manual_seed(seed)
    slots = torch.randperm(NUM_PAGES * PAGE, generator=gen)[:num_tokens]
    kv_a = torch.randn(num_tokens, LATENT + ROPE, generator=gen).to(dtype)
    latent, k_pe = kv_a.split([LATENT, ROPE], dim=-1)  # as kv_a_proj's output is split
    return slots, latent, k_pe


@pytest.mark.parametrize(
    "input_dtype,pool_dtype",
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.bfloat16),
        (torch.float32, torch.bfloat16),
        (torch.float16, torch.float16),
    ],
)
def test_kv_store_matches_reference(input_dtype: torch.dtype, pool_dtype: torch.dtype) -> None:
    slots, latent, k_pe = _inputs(num_tokens=13, dtype=input_dtype, seed=0)
    pool = torch.full((NUM_PAGES, PAGE, LATENT + ROPE), float("nan"), dtype=pool_dtype)
    expected = pool.clone()

    kv_store_triton(pool, slots, latent, k_pe)
    kv_store_torch(expected, slots, latent, k_pe)

    flat = pool.view(-1, LATENT + ROPE)
    written, reference = flat[slots], expected.view(-1, LATENT + ROPE)[slots]
    if input_dtype == pool_dtype:
        assert torch.equal(written, reference)
    else:  # the interpreter truncates float32 -> bfloat16 where torch (and a GPU) rounds: one ulp
        torch.testing.assert_close(written.float(), reference.float(), rtol=2**-7, atol=0.0)
    untouched = torch.ones(NUM_PAGES * PAGE, dtype=torch.bool)
    untouched[slots] = False
    assert torch.isnan(flat[untouched]).all()


def test_kv_store_into_a_layer_of_a_larger_pool() -> None:
    """One layer of ``[layers, pages, page_size, L+R]``: the page stride spans that layer only."""
    slots, latent, k_pe = _inputs(num_tokens=6, dtype=torch.float32, seed=1)
    pool = torch.full((2, NUM_PAGES, PAGE, LATENT + ROPE), float("nan"))
    kv_store_triton(pool[1], slots, latent, k_pe)
    assert torch.isnan(pool[0]).all()
    flat = pool[1].reshape(-1, LATENT + ROPE)
    assert torch.equal(flat[slots], torch.cat([latent, k_pe], dim=-1))
    assert int((~torch.isnan(flat)).any(dim=-1).sum()) == len(slots)


def test_kv_store_skips_padding_slots_and_empty_batches() -> None:
    _, latent, k_pe = _inputs(num_tokens=3, dtype=torch.float32, seed=2)
    pool = torch.full((NUM_PAGES, PAGE, LATENT + ROPE), float("nan"))
    kv_store_triton(pool, torch.tensor([5, -1, 30]), latent, k_pe)
    flat = pool.view(-1, LATENT + ROPE)
    assert torch.equal(flat[[5, 30]], torch.cat([latent, k_pe], dim=-1)[[0, 2]])
    assert int((~torch.isnan(flat)).any(dim=-1).sum()) == 2

    kv_store_triton(pool, torch.empty(0, dtype=torch.int64), latent[:0], k_pe[:0])
    assert int((~torch.isnan(flat)).any(dim=-1).sum()) == 2


def test_kv_store_compiles_for_h200() -> None:
    ((stack, _),) = sm90_resources(
        [
            {
                "module": "tandem.model.kernels.kv_store_triton",
                "kernel": "_kv_store_kernel",
                "constexprs": {
                    "D_LATENT": DEEPSEEK_LATENT,
                    "D_PE": DEEPSEEK_ROPE,
                    "BLOCK_LATENT": DEEPSEEK_LATENT,
                    "BLOCK_PE": DEEPSEEK_ROPE,
                }
                | dict.fromkeys(["stride_kv_d", "stride_latent_d", "stride_pe_d"], 1),
                "pointers": {"kv": "*bf16", "slot": "*i64", "latent": "*bf16", "pe": "*bf16"},
                "num_warps": 4,
                "num_stages": 1,
            }
        ]
    )
    assert stack == 0
