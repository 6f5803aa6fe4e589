"""The fused latent norm + RoPE + KV store kernel against the unfused ops it replaces (Triton's
interpreter on CPU): the torch references, and the three Triton kernels, which round the same way
and so must match it bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tandem.model.config import RopeConfig
from tandem.model.kernels import rope_kv_store_triton as fused_module
from tandem.model.kernels.kv_store_triton import kv_store_triton
from tandem.model.kernels.mla_attention import kv_store_torch
from tandem.model.kernels.norm import rms_norm_torch
from tandem.model.kernels.norm_triton import rms_norm_triton
from tandem.model.kernels.rope import apply_rope_torch, rope_cos_sin_table
from tandem.model.kernels.rope_kv_store_triton import rope_kv_store_triton
from tandem.model.kernels.rope_triton import apply_rope_triton
from tests.model.kernels.test_mla_decode import DEEPSEEK_LATENT, DEEPSEEK_ROPE, NanTorch, sm90_resources

PAGE, EPS, NOPE = 4, 1e-6, 16
YARN = RopeConfig("yarn", 10000.0, 40.0, 4096, 32.0, 1.0, 1.0, 1.0)


@pytest.fixture(autouse=True)
def _poison_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The rotated queries start as NaN, so a row or head the kernel fails to write fails."""
    monkeypatch.setattr(fused_module, "torch", NanTorch())


T = torch.Tensor
FusedArgs = tuple[T, T, T, T, float, T, T, bool, T, T]


@dataclass
class Case:
    """Inputs as ``MLAttention.forward`` passes them: ``q_pe`` the tail of each head of ``q``,
    ``latent`` and ``k_pe`` the two parts of ``kv_a_proj``'s output rows (strided views)."""

    q_pe: torch.Tensor
    k_pe: torch.Tensor
    latent: torch.Tensor
    weight: torch.Tensor
    cos: torch.Tensor
    sin: torch.Tensor
    slots: torch.Tensor
    pool: torch.Tensor

    def args(self, pool: torch.Tensor, interleave: bool) -> FusedArgs:
        return (
            self.q_pe,
            self.k_pe,
            self.latent,
            self.weight,
            EPS,
            self.cos,
            self.sin,
            interleave,
            pool,
            self.slots,
        )


def _case(
    tokens: int, heads: int, rope_dim: int, latent_dim: int, dtype: torch.dtype, seed: int, padding: int = 0
) -> Case:
    gen = torch.Generator().manual_seed(seed)
    num_pages = -(-tokens // PAGE) + 2
    q = torch.randn(tokens, heads, NOPE + rope_dim, generator=gen).to(dtype)
    kv_a = torch.randn(tokens, latent_dim + rope_dim, generator=gen).to(dtype)
    latent, k_pe = kv_a.split([latent_dim, rope_dim], dim=-1)
    q_pe = q.split([NOPE, rope_dim], dim=-1)[1]
    assert q_pe.stride() == (heads * (NOPE + rope_dim), NOPE + rope_dim, 1)
    assert latent.stride() == k_pe.stride() == (latent_dim + rope_dim, 1)
    cos, sin = rope_cos_sin_table(YARN, rope_dim, 8192)
    positions = torch.randint(0, 8192, (tokens,), generator=gen)
    slots = torch.randperm(num_pages * PAGE, generator=gen)[:tokens]
    slots[torch.randperm(tokens, generator=gen)[:padding]] = -1
    return Case(
        q_pe=q_pe,
        k_pe=k_pe,
        latent=latent,
        weight=(1 + 0.1 * torch.randn(latent_dim, generator=gen)).to(dtype),
        cos=cos[positions].to(dtype),
        sin=sin[positions].to(dtype),
        slots=slots,
        pool=torch.full((num_pages, PAGE, latent_dim + rope_dim), float("nan"), dtype=dtype),
    )


def _torch_path(case: Case, pool: torch.Tensor, interleave: bool) -> torch.Tensor:
    latent = rms_norm_torch(case.latent, case.weight, EPS)[0]
    q_pe, k_pe = apply_rope_torch(case.q_pe, case.k_pe, case.cos, case.sin, interleave)
    kv_store_torch(pool, case.slots, latent, k_pe)
    return q_pe


def _triton_path(case: Case, pool: torch.Tensor, interleave: bool) -> torch.Tensor:
    latent = rms_norm_triton(case.latent, case.weight, EPS)[0]
    q_pe, k_pe = apply_rope_triton(case.q_pe, case.k_pe, case.cos, case.sin, interleave)
    kv_store_triton(pool, case.slots, latent, k_pe)
    return q_pe


def _written(pool: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The rows at the valid slots, after checking that no other row was touched."""
    flat = pool.view(-1, pool.shape[-1])
    untouched = torch.ones(flat.shape[0], dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert torch.isnan(flat[untouched]).all()
    return flat[slots[slots >= 0]]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize(
    "heads,rope_dim,latent_dim",
    [(5, 8, 32), (17, 24, 48)],  # 17 heads: a second, partial head block; R/2 = 12 and L = 48 masked
)
def test_matches_the_unfused_ops(
    dtype: torch.dtype, interleave: bool, heads: int, rope_dim: int, latent_dim: int
) -> None:
    case = _case(
        tokens=9, heads=heads, rope_dim=rope_dim, latent_dim=latent_dim, dtype=dtype, seed=heads, padding=2
    )
    pool, torch_pool, triton_pool = case.pool, case.pool.clone(), case.pool.clone()

    q_out = rope_kv_store_triton(*case.args(pool, interleave))
    q_torch = _torch_path(case, torch_pool, interleave)
    q_triton = _triton_path(case, triton_pool, interleave)

    assert q_out.shape == q_torch.shape and q_out.is_contiguous() and not torch.isnan(q_out).any()
    rows = _written(pool, case.slots)
    assert torch.equal(q_out, q_triton) and torch.equal(rows, _written(triton_pool, case.slots))
    torch_rows = _written(torch_pool, case.slots)
    if dtype == torch.float32:  # the same operations in the same order: the same bits
        assert torch.equal(q_out, q_torch)
        assert torch.equal(rows[:, latent_dim:], torch_rows[:, latent_dim:])
        # the norm's mean of squares sums in another order than torch's
        torch.testing.assert_close(rows[:, :latent_dim], torch_rows[:, :latent_dim], rtol=1e-6, atol=1e-6)
    else:  # torch rounds each product to bfloat16, the kernel only the result: within two ulps
        torch.testing.assert_close(q_out.float(), q_torch.float(), rtol=2**-6, atol=2**-6)
        torch.testing.assert_close(rows.float(), torch_rows.float(), rtol=2**-6, atol=2**-6)


def test_padding_rows_write_nothing_and_a_layer_of_a_larger_pool() -> None:
    """A batch padded for a CUDA graph: every slot -1 leaves the pool alone but rotates the
    queries; then one layer of ``[layers, pages, page_size, L+R]``, where the page stride spans it."""
    case = _case(tokens=6, heads=3, rope_dim=8, latent_dim=32, dtype=torch.float32, seed=7)
    expected = _torch_path(case, case.pool.clone(), True)
    padded = torch.full_like(case.slots, -1)
    q_out = rope_kv_store_triton(*Case(**{**vars(case), "slots": padded}).args(case.pool, True))
    assert torch.isnan(case.pool).all()
    assert torch.equal(q_out, expected)

    layers = torch.full((2, *case.pool.shape), float("nan"))
    rope_kv_store_triton(*case.args(layers[1], True))
    torch_pool = case.pool.clone()
    _torch_path(case, torch_pool, True)
    assert torch.isnan(layers[0]).all()
    written = _written(layers[1], case.slots)
    torch.testing.assert_close(written, _written(torch_pool, case.slots), rtol=1e-6, atol=1e-6)


def test_float32_activations_into_a_bfloat16_pool_and_empty_batches() -> None:
    case = _case(tokens=5, heads=2, rope_dim=8, latent_dim=32, dtype=torch.float32, seed=8, padding=1)
    pool, reference = (torch.full(case.pool.shape, float("nan"), dtype=torch.bfloat16) for _ in range(2))
    rope_kv_store_triton(*case.args(pool, False))
    _triton_path(case, reference, False)
    assert torch.equal(_written(pool, case.slots), _written(reference, case.slots))

    empty = _case(tokens=0, heads=2, rope_dim=8, latent_dim=32, dtype=torch.float32, seed=9)
    assert rope_kv_store_triton(*empty.args(pool, False)).shape == (0, 2, 8)
    with pytest.raises(ValueError, match="do not fit"):
        rope_kv_store_triton(*case.args(pool[..., :-1], False))


def test_compiles_for_h200_without_spills() -> None:
    """DeepSeek-V3 shapes: 128 heads in blocks of 16, rope 64, latent 512, bf16 throughout.
    ``eps`` is passed as a constant (the harness types scalars as i32); it changes no registers."""
    ((stack, _),) = sm90_resources(
        [
            {
                "module": "tandem.model.kernels.rope_kv_store_triton",
                "kernel": "_rope_kv_store_kernel",
                "constexprs": {
                    "HALF": DEEPSEEK_ROPE // 2,
                    "D_LATENT": DEEPSEEK_LATENT,
                    "INTERLEAVE": True,
                    "BLOCK_H": fused_module.HEADS_PER_PROGRAM,
                    "BLOCK_HALF": DEEPSEEK_ROPE // 2,
                    "BLOCK_LATENT": DEEPSEEK_LATENT,
                    "eps": 1e-6,
                    "stride_kv_d": 1,
                },
                "pointers": dict.fromkeys(
                    ["q", "k", "latent", "norm_w", "cos", "sin", "q_out", "kv"], "*bf16"
                )
                | {"slot": "*i64"},
                "num_warps": 4,
                "num_stages": 1,
            }
        ]
    )
    assert stack == 0
