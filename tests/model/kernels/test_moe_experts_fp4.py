"""FP4 experts (DeepSeek-V4's published MXFP4): the format's bytes, the torch reference against
the dequantised experts (bit for bit), the Triton kernels (Triton's interpreter on CPU) against
the reference, and their sm_90 compilation at DeepSeek-V4-Flash's expert shapes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

import pytest
import torch

from tandem.model.kernels.fp4 import dequantize_fp4, fp4_shapes, quantize_fp4
from tandem.model.kernels.moe import ExpertScales, fused_experts_torch
from tandem.model.kernels.moe_experts_triton import (
    ExpertDtypeMismatch,
    fused_experts_triton,
    pick_expert_blocks,
)
from tests.model.kernels.test_moe_experts import CUOBJDUMP, REPO_ROOT
from tests.model.kernels.test_moe_experts_fp8 import _sm90_compile


def _experts(num: int, hidden: int, inter: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    """``(w_gate_up, w_down, gate_up scales, down scales)`` as bytes, gate and up quantised apart."""
    w13, w2, s13, s2 = [], [], [], []
    for _ in range(num):
        gate = quantize_fp4(torch.randn(inter, hidden, generator=gen) / hidden**0.5)
        up = quantize_fp4(torch.randn(inter, hidden, generator=gen) / hidden**0.5)
        down = quantize_fp4(torch.randn(hidden, inter, generator=gen) / inter**0.5)
        w13.append(torch.cat([gate[0], up[0]]))
        s13.append(torch.cat([gate[1], up[1]]))
        w2.append(down[0])
        s2.append(down[1])
    return torch.stack(w13), torch.stack(w2), torch.stack(s13), torch.stack(s2)


def test_the_bytes_are_the_published_layout() -> None:
    """Input ``2j`` is byte ``j``'s low nibble, ``2j + 1`` its high one; one E8M0 byte a 32."""
    row = torch.tensor([[0.5, -6.0, 1.0, 3.0] + [0.0] * 28 + [8.0, -0.25] + [0.0] * 30])
    packed, scale = quantize_fp4(row)
    assert packed.dtype == scale.dtype == torch.uint8
    assert packed.shape == (1, 32) and scale.shape == (1, 2)
    assert packed[0, :2].tolist() == [0x1 | 0xF << 4, 0x2 | 0x5 << 4]  # 0.5, -6; 1, 3 at scale 2^0
    assert scale[0].tolist() == [127, 128]  # 6 fits 2^0; 8 needs 2^1
    assert packed[0, 16].item() == 0x6  # 8 / 2 = 4 (nibble 6); -0.25 / 2 rounds to 0 (nibble 0)
    assert torch.equal(dequantize_fp4(packed, scale)[0, :4], row[0, :4])
    # the checkpoint's spellings of the same bytes read alike
    assert torch.equal(
        dequantize_fp4(packed.view(torch.int8), scale.view(torch.float8_e8m0fnu)),
        dequantize_fp4(packed, scale),
    )
    with pytest.raises(ValueError, match="multiple of 32"):
        fp4_shapes(8, 48)


def test_every_value_is_exact_in_bfloat16_and_requantises_to_itself() -> None:
    gen = torch.Generator().manual_seed(0)
    weight = torch.randn(16, 256, generator=gen) * torch.logspace(-3, 2, 256)
    values = dequantize_fp4(*quantize_fp4(weight))
    assert torch.equal(values.bfloat16().float(), values)
    assert torch.equal(dequantize_fp4(*quantize_fp4(values)), values)
    # each number rounds to its nearest: off by at most half of e2m1's widest gap (2) at its scale
    scale = torch.exp2(quantize_fp4(weight)[1].float() - 127).repeat_interleave(32, dim=1)
    assert ((values - weight).abs() <= scale).all()


@pytest.mark.parametrize(
    ("dtype", "hidden", "inter", "tokens"),
    [(torch.float32, 64, 32, 5), (torch.bfloat16, 96, 64, 9), (torch.float32, 256, 160, 3)],
)
@pytest.mark.parametrize("limit", [None, 0.5])
def test_triton_fp4_experts_match_the_reference(
    dtype: torch.dtype, hidden: int, inter: int, tokens: int, limit: float | None
) -> None:
    """D not a multiple of the step (96), I no power of two (160), pairs of experts held
    elsewhere (ids past the local four), clipped and not; the reference is the dequantised
    experts' result bit for bit."""
    gen = torch.Generator().manual_seed(hidden + tokens)
    w13, w2, s13, s2 = _experts(4, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    ids = torch.randint(0, 6, (tokens, 2), generator=gen)
    weights = torch.rand(tokens, 2, generator=gen)
    scales = ExpertScales.fp4(s13, s2)
    ref = fused_experts_torch(x, weights, ids, w13, w2, 1, scales, limit)
    dq13 = torch.stack([dequantize_fp4(w, s) for w, s in zip(w13, s13, strict=True)]).to(dtype)
    dq2 = torch.stack([dequantize_fp4(w, s) for w, s in zip(w2, s2, strict=True)]).to(dtype)
    assert torch.equal(fused_experts_torch(x, weights, ids, dq13, dq2, 1, None, limit), ref)
    out = fused_experts_triton(x, weights, ids, w13, w2, 1, scales, limit)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (out.float() - ref.float()).abs().max() <= tol * ref.float().abs().max()
    assert ref.abs().max() > 0


def test_fp4_scales_need_byte_weights() -> None:
    gen = torch.Generator().manual_seed(1)
    w13, w2, s13, s2 = _experts(2, 64, 32, gen)
    x, ids, weights = torch.randn(3, 64), torch.zeros(3, 1, dtype=torch.int64), torch.ones(3, 1)
    with pytest.raises(ExpertDtypeMismatch, match="FP8 or FP4 bytes"):
        fused_experts_triton(x, weights, ids, w13.float(), w2.float(), 0, ExpertScales.fp4(s13, s2))


def deepseek_v4_fp4_expert_builds() -> dict[str, tuple[int, bool]]:
    """``(spill bytes, tensor-core dots)`` of the FP4 kernels at DeepSeek-V4-Flash's expert shapes
    (D=4096, I=2048, 256 experts over a DEP rank, top 6, bfloat16 activations) with the blocks a
    decode batch (64 tokens) and a prefill chunk (4096) pick."""
    from tandem.model.kernels.moe_experts_fp4_triton import (
        _fp4_down_kernel,
        _fp4_gate_up_silu_kernel,
        fp4_step,
        gate_up_step,
    )

    hidden, inter, num_local, top_k = 4096, 2048, 128, 6
    builds: dict[str, tuple[int, bool]] = {}
    rows = dict.fromkeys(["sorted_pair_ids_ptr", "block_expert_ptr"], "*i32")
    strides = ["w_stride_e", "w_stride_n", "s_stride_e", "s_stride_n"]
    for num_tokens in (64, 4096):
        blocks = pick_expert_blocks(num_tokens * top_k, num_local, hidden, inter, torch.bfloat16)
        shared: dict[str, Any] = {"DOT_PRECISION": "tf32", "UPCAST_DOT": False, "GROUP": 32}
        shared["BLOCK_M"] = blocks.block_m
        sig = {"x_ptr": "*bf16", "w_ptr": "*u8", "s_ptr": "*u8", "h_ptr": "*bf16"} | rows
        sig |= dict.fromkeys(["num_pairs", "hidden", "inter", "x_stride_t", *strides, "h_stride_m"], "i32")
        sig["limit"] = "fp32"
        consts = {**shared, "TOP_K": top_k, "CLIP": True, "BLOCK_N": blocks.gate_up_block_n}
        consts["BLOCK_K"] = gate_up_step(hidden, blocks.block_m)
        aligned = [name for name in sig if name not in ("num_pairs", "limit")]
        builds[f"gate_up/{num_tokens}"] = _sm90_compile(
            _fp4_gate_up_silu_kernel, sig, consts, aligned, blocks.num_warps
        )
        sig = {
            "h_ptr": "*bf16",
            "w_ptr": "*u8",
            "s_ptr": "*u8",
            "y_ptr": "*bf16",
            "topk_weights_ptr": "*fp32",
        }
        sig |= rows | dict.fromkeys(
            ["num_pairs", "hidden", "inter", "h_stride_m", *strides, "y_stride_p"], "i32"
        )
        consts = {**shared, "BLOCK_N": blocks.down_block_n, "BLOCK_K": fp4_step(inter, 128)}
        aligned = [name for name in sig if name != "num_pairs"]
        builds[f"down/{num_tokens}"] = _sm90_compile(_fp4_down_kernel, sig, consts, aligned, blocks.num_warps)
    return builds


def test_fp4_kernels_compile_for_h200_without_spills() -> None:
    """In a child process without ``TRITON_INTERPRET``, as ``test_moe_experts`` compiles. (The
    second cell is whether the PTX has FP8 dots: these dequantise into bfloat16, so none.)"""
    if not CUOBJDUMP.exists():
        pytest.skip("Triton's NVIDIA tools are not installed")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = (
        "import json; from tests.model.kernels.test_moe_experts_fp4 import "
        "deepseek_v4_fp4_expert_builds as f; print(json.dumps(f()))"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert child.returncode == 0, child.stderr[-3000:]
    builds = json.loads(child.stdout.splitlines()[-1])
    assert len(builds) == 4, builds
    assert all(spills == 0 and not fp8_mma for spills, fp8_mma in builds.values()), builds
