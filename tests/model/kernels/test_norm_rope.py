"""RMSNorm and RoPE kernels against their torch references (Triton's interpreter on CPU)."""

from __future__ import annotations

import pytest
import torch

from tandem.model.config import RopeConfig
from tandem.model.kernels import norm_triton, rope_triton
from tandem.model.kernels.norm import rms_norm_torch
from tandem.model.kernels.norm_triton import rms_norm_triton
from tandem.model.kernels.rope import apply_rope_torch, rope_cos_sin_table
from tandem.model.kernels.rope_triton import apply_rope_triton
from tests.model.kernels.test_mla_decode import NanTorch

# Triton's interpreter truncates float32 -> bfloat16 (a GPU rounds to nearest), so each rounding
# step may land one bfloat16 ulp (2^-7 relative) away from torch's: allow a few.
TOL = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


@pytest.fixture(autouse=True)
def _poison_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every buffer the kernels allocate starts as NaN, so an element they fail to write fails."""
    monkeypatch.setattr(norm_triton, "torch", NanTorch())
    monkeypatch.setattr(rope_triton, "torch", NanTorch())


def _close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any()
    torch.testing.assert_close(out.float(), ref.float(), rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,dim", [(1, 64), (7, 48), (33, 512)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, rows: int, dim: int, with_residual: bool) -> None:
    gen = torch.Generator().manual_seed(rows * dim)
    base = torch.randn(rows, dim + 8, generator=gen).to(dtype)
    x = base[:, :dim]  # row-strided view, as the latent split of kv_a_proj's output is
    weight = (1 + 0.1 * torch.randn(dim, generator=gen)).to(dtype)
    residual = torch.randn(rows, dim, generator=gen).to(dtype) if with_residual else None
    out, res = rms_norm_triton(x, weight, 1e-6, residual)
    ref_out, ref_res = rms_norm_torch(x, weight, 1e-6, residual)
    _close(out, ref_out, dtype)
    _close(res, ref_res, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize(
    "rope",
    [
        RopeConfig(),
        RopeConfig("yarn", 10000.0, 40.0, 4096, 32.0, 1.0, 1.0, 1.0),
    ],
)
def test_rope(dtype: torch.dtype, interleave: bool, rope: RopeConfig) -> None:
    gen = torch.Generator().manual_seed(3)
    tokens, heads, nope, rope_dim = 11, 5, 16, 64
    cos, sin = rope_cos_sin_table(rope, rope_dim, 8192)
    positions = torch.randint(0, 8192, (tokens,), generator=gen)
    cos, sin = cos[positions].to(dtype), sin[positions].to(dtype)
    q = torch.randn(tokens, heads, nope + rope_dim, generator=gen).to(dtype)
    kv = torch.randn(tokens, 32 + rope_dim, generator=gen).to(dtype)
    q_pe, k_pe = q[..., nope:], kv[:, 32:]  # strided views, as the model passes them
    out_q, out_k = apply_rope_triton(q_pe, k_pe, cos, sin, interleave)
    ref_q, ref_k = apply_rope_torch(q_pe, k_pe, cos, sin, interleave)
    _close(out_q, ref_q, dtype)
    _close(out_k, ref_k, dtype)
