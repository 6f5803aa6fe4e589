"""The block-scaled FP8 GEMM and FP8 experts (Triton's interpreter on CPU) against the torch
references, and the references against the dequantised weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tandem.model.kernels.fp8 import (
    FP8_DTYPE,
    dequantize_fp8_block,
    dequantize_gate_up,
    fp8_linear_torch,
    quantize_activation_groups,
    quantize_fp8_block,
)
from tandem.model.kernels.fp8_gemm_triton import fp8_linear_triton, quantize_activations
from tandem.model.kernels.moe import ExpertScales, fused_experts_torch
from tandem.model.kernels.moe_experts_triton import fused_experts_triton
from tests.model.kernels.test_moe_experts import CUOBJDUMP, REPO_ROOT

SHAPES = [(5, 96, 200, (128, 128)), (33, 130, 64, (16, 32)), (1, 256, 256, (128, 128)), (0, 64, 64, (32, 32))]


def _weight(n: int, k: int, block: tuple[int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return quantize_fp8_block(torch.randn(n, k, generator=gen), block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "block"), SHAPES)
def test_dequant_mode_is_the_dequantised_weight(
    dtype: torch.dtype, m: int, n: int, k: int, block: tuple[int, int]
) -> None:
    wq, ws = _weight(n, k, block, seed=m + n)
    gen = torch.Generator().manual_seed(k)
    x, bias = torch.randn(m, k, generator=gen).to(dtype), torch.randn(n, generator=gen).to(dtype)
    want = F.linear(x, dequantize_fp8_block(wq, ws, block).to(dtype), bias)
    assert torch.equal(fp8_linear_torch(x, wq, ws, block, bias, "dequant"), want)
    got = fp8_linear_triton(x, wq, ws, block, bias, "dequant")
    assert got.dtype == dtype and got.shape == (m, n)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    if m:
        assert float((got.float() - want.float()).abs().max() / want.float().abs().max()) < tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "block"), SHAPES)
def test_quant_mode_is_fp8_activations_times_the_dequantised_weight(
    dtype: torch.dtype, m: int, n: int, k: int, block: tuple[int, int]
) -> None:
    wq, ws = _weight(n, k, block, seed=m + n)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)).to(dtype)
    q, s = quantize_activation_groups(x, block[1])
    groups = s.repeat_interleave(block[1], dim=1)[:, :k]
    emulated = F.linear(q.float() * groups, dequantize_fp8_block(wq, ws, block))
    ref = fp8_linear_torch(x, wq, ws, block, None, "quant")
    got = fp8_linear_triton(x, wq, ws, block, None, "quant")
    if not m:
        assert got.shape == (0, n)
        return
    scale = emulated.abs().max()
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert float((ref.float() - emulated).abs().max() / scale) < tol
    assert float((got.float() - emulated).abs().max() / scale) < tol
    # and it really is coarser than the dequantised weight alone
    assert not torch.allclose(ref.float(), F.linear(x.float(), dequantize_fp8_block(wq, ws, block)))


def test_activation_quantisation_kernel_rounds_like_torch() -> None:
    """Every magnitude class, including values just below a power of two that round up into
    the next binade (Triton's interpreter cast alone gets those wrong) and exact ties."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(6, 300, generator=gen) * torch.logspace(-4, 2, 300)
    x[0, :8] = torch.tensor([125.0, -126.5, 7.9, 100.0, 104.0, 448.0, 0.0, 1e-9])
    q, s = quantize_activations(x, 128)
    q_ref, s_ref = quantize_activation_groups(x, 128)
    assert q.dtype == FP8_DTYPE and torch.equal(s, s_ref)
    assert torch.equal(q.float(), q_ref.float())


def test_fp8_experts_match_the_dequantised_experts() -> None:
    """Gate and up scales kept apart: I = 40 is not a multiple of the 16-row block."""
    num_experts, hidden, inter, tokens, top_k, block = 6, 64, 40, 9, 2, (16, 32)
    gen = torch.Generator().manual_seed(3)
    w13, w2, s13, s2 = [], [], [], []
    for _ in range(num_experts):
        gate, sg = quantize_fp8_block(torch.randn(inter, hidden, generator=gen), block)
        up, su = quantize_fp8_block(torch.randn(inter, hidden, generator=gen), block)
        down, sd = quantize_fp8_block(torch.randn(hidden, inter, generator=gen), block)
        w13.append(torch.cat([gate, up]))
        s13.append(torch.cat([sg, su]))
        w2.append(down)
        s2.append(sd)
    scales = ExpertScales(torch.stack(s13), torch.stack(s2), block, "dequant")
    fused13, fused2 = torch.stack(w13), torch.stack(w2)
    dense13 = torch.stack([dequantize_gate_up(w, s, block) for w, s in zip(w13, s13, strict=True)])
    dense2 = torch.stack([dequantize_fp8_block(w, s, block) for w, s in zip(w2, s2, strict=True)])
    x = torch.randn(tokens, hidden, generator=gen)
    ids = torch.randint(0, num_experts + 2, (tokens, top_k), generator=gen)  # 6, 7: held elsewhere
    weights = torch.rand(tokens, top_k, generator=gen)
    want = fused_experts_torch(x, weights, ids, dense13, dense2, 1)
    assert torch.equal(fused_experts_torch(x, weights, ids, fused13, fused2, 1, scales), want)
    got = fused_experts_triton(x, weights, ids, fused13, fused2, 1, scales)
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def deepseek_v3_fp8_gemm_spill_bytes() -> dict[str, int]:
    """Spill bytes of the FP8 GEMM compiled for sm_90 at DeepSeek-V3's o_proj (K=16384,
    N=7168, 128x128 blocks), with FP8 tensor-core dots (quant) and bf16 ones (dequant)."""
    from tandem.model.kernels.fp8_gemm_triton import _fp8_gemm_kernel
    from tandem.model.kernels.tuning import fp8_gemm_tiles
    from tests.model.kernels.test_moe_experts import _sm90_spill_bytes

    spills = {}
    for mode in ("quant", "dequant"):
        for rows in (64, 4096):
            tiles = fp8_gemm_tiles(rows, 7168, 16384, 128, mode)
            a_type = "*fp8e4nv" if mode == "quant" else "*bf16"
            sig = {"a_ptr": a_type, "a_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32"}
            sig |= {"bias_ptr": "*bf16", "c_ptr": "*bf16"}
            strides = ["a_stride_m", "a_scale_stride_m", "w_stride_n", "w_scale_stride_n", "c_stride_m"]
            sig |= dict.fromkeys(["M", "N", "K", *strides], "i32")
            consts = {"SCALE_BO": 128, "SCALE_BI": 128, "QUANT": mode == "quant", "HAS_BIAS": False}
            consts |= {"UPCAST": False, "DOT_PRECISION": "tf32", "BLOCK_M": tiles.block_m}
            consts |= {"BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k}
            aligned = [name for name in sig if name not in ("M", "a_scale_stride_m")]
            warps = tiles.num_warps
            spills[f"{mode}/{rows}"] = _sm90_spill_bytes(_fp8_gemm_kernel, sig, consts, aligned, warps)
    return spills


def test_fp8_gemm_compiles_for_h200_without_spills() -> None:
    if not CUOBJDUMP.exists():
        pytest.skip("Triton's NVIDIA tools are not installed")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = (
        "import json; from tests.model.kernels.test_fp8_gemm import deepseek_v3_fp8_gemm_spill_bytes as f; "
        "print(json.dumps(f()))"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert child.returncode == 0, child.stderr[-3000:]
    spills = json.loads(child.stdout.splitlines()[-1])
    assert len(spills) == 4 and not any(spills.values()), spills
