"""Triton absorbed-form extend attention against the plain-form ``extend_attention_torch``.

Same pools as the decode tests (NaN outside every request's tokens, NaN page-table padding) and
NaN-filled buffers in the kernel module, in Triton's interpreter on CPU.
"""

from __future__ import annotations

import pytest
import torch

from tandem.model.attention_metadata import AttentionMetadata
from tandem.model.kernels import mla_extend_triton
from tandem.model.kernels.mla_attention import extend_attention_torch
from tandem.model.kernels.mla_extend_triton import (
    BLOCK_N,
    BLOCK_N_WIDE,
    NUM_WARPS,
    ROWS,
    ROWS_WIDE,
    extend_attention_latent,
    extend_attention_triton,
)
from tests.model.kernels.test_mla_decode import (
    LATENT,
    NOPE,
    ROPE,
    SCALE,
    SM90_SHARED_BYTES,
    TOL,
    NanTorch,
    build_meta,
    deepseek_constexprs,
    paged_batch,
    sm90_resources,
)

V_DIM = 16


@pytest.fixture(autouse=True)
def _poison_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mla_extend_triton, "torch", NanTorch())


def _extend_inputs(
    prefix_and_query_lens: list[tuple[int, int]], heads: int, page_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    query_lens = [n for _, n in prefix_and_query_lens]
    seq_lens = [p + n for p, n in prefix_and_query_lens]
    pool, page_ids, nan_page = paged_batch(seq_lens, page_size, dtype, gen)
    meta = build_meta(page_size, query_lens, seq_lens, page_ids, nan_page)
    q = torch.randn(sum(query_lens), heads, NOPE + ROPE, generator=gen).to(dtype)
    w_kv_b = (torch.randn(heads * (NOPE + V_DIM), LATENT, generator=gen) / LATENT**0.5).to(dtype)
    return q, pool, meta, w_kv_b


def _check(q: torch.Tensor, pool: torch.Tensor, meta: AttentionMetadata, w_kv_b: torch.Tensor) -> None:
    heads = q.shape[1]
    out = extend_attention_triton(q, pool, meta, w_kv_b, heads, NOPE, V_DIM, SCALE)
    ref = extend_attention_torch(q, pool, meta, w_kv_b, heads, NOPE, V_DIM, SCALE)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any()
    tol = TOL[ref.dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_extend_ragged_batch_with_prefixes(dtype: torch.dtype) -> None:
    """No prefix; a prefix that ends mid-page; one new token; a prefix of several pages."""
    _check(*_extend_inputs([(0, 2), (3, 5), (8, 1), (13, 9)], heads=4, page_size=4, dtype=dtype, seed=0))


def test_extend_long_queries_over_several_query_blocks() -> None:
    """40 and 33 new tokens: two query blocks each, one head per program, causal tiles skipped."""
    _check(*_extend_inputs([(0, 40), (5, 33)], heads=4, page_size=4, dtype=torch.float32, seed=1))


def test_extend_empty_batch() -> None:
    q, pool, _, w_kv_b = _extend_inputs([(0, 2)], heads=4, page_size=4, dtype=torch.float32, seed=2)
    meta = AttentionMetadata.build(4, [], [], [])
    out = extend_attention_triton(q[:0], pool, meta, w_kv_b, 4, NOPE, V_DIM, SCALE)
    assert out.shape == (0, 4, V_DIM)


@pytest.mark.kernels_full
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [4, 20])
@pytest.mark.parametrize(
    "prefix_and_query_lens,page_size",
    [
        ([(0, 8), (8, 9), (100, 3), (6, 17)], 8),
        ([(0, 1), (7, 1), (30, 1)], 4),  # one new token each: many heads per program
        ([(0, 70)], 8),
        ([(37, 2), (0, 2)], 4),
    ],
)
def test_extend_full(
    dtype: torch.dtype, heads: int, prefix_and_query_lens: list[tuple[int, int]], page_size: int
) -> None:
    _check(*_extend_inputs(prefix_and_query_lens, heads, page_size, dtype, seed=len(prefix_and_query_lens)))


@pytest.mark.kernels_full
@pytest.mark.parametrize("rows,block_n", [(16, 16), (64, 16), (32, 64)])
def test_extend_full_tile_shapes(rows: int, block_n: int) -> None:
    """The latent kernel alone, other tilings, against the torch reference's absorbed equivalent."""
    q, pool, meta, w_kv_b = _extend_inputs([(0, 5), (19, 21), (3, 2)], 20, 4, torch.float32, seed=5)
    w = w_kv_b.view(20, NOPE + V_DIM, LATENT)
    q_latent = torch.einsum("thn,hnl->thl", q[..., :NOPE], w[:, :NOPE])
    o_latent = extend_attention_latent(q_latent, q[..., NOPE:], pool, meta, SCALE, rows, block_n)
    out = torch.einsum("thl,hvl->thv", o_latent, w[:, NOPE:])
    ref = extend_attention_torch(q, pool, meta, w_kv_b, 20, NOPE, V_DIM, SCALE)
    torch.testing.assert_close(out, ref, rtol=TOL[torch.float32], atol=TOL[torch.float32])


@pytest.mark.parametrize(
    "dtype",
    [
        "bf16",
        pytest.param("fp32", marks=pytest.mark.kernels_full),
        pytest.param("fp64", marks=pytest.mark.kernels_full),
    ],
)
def test_extend_compiles_for_h200_without_spills(dtype: str) -> None:
    """DeepSeek-V3 shapes with the tiles a launch picks: one head per program (long extends) and
    every row a different head (one new token each, H=128)."""
    rows, block_n = (ROWS, BLOCK_N) if dtype == "bf16" else (ROWS_WIDE, BLOCK_N_WIDE)
    pointers = dict.fromkeys(["q", "q_pe", "kv", "out"], f"*{dtype}")
    pointers |= dict.fromkeys(["page_table", "query_start", "seq_lens"], "*i64")
    specs = [
        {
            "module": "tandem.model.kernels.mla_extend_triton",
            "kernel": "_extend_kernel",
            "constexprs": deepseek_constexprs(dtype)
            | {"BLOCK_M": rows // block_h, "BLOCK_H": block_h, "BLOCK_N": block_n},
            "pointers": pointers,
            "num_warps": NUM_WARPS,
            "num_stages": 2,
        }
        for block_h in (1, rows)
    ]
    for stack, shared in sm90_resources(specs):
        assert stack == 0 and shared <= SM90_SHARED_BYTES
