"""FP8 experts in ``quant`` mode (FP8 activations, FP8 x FP8 dots): the Triton kernels (Triton's
interpreter on CPU) against the torch emulation that quantises where they do, tightly, and
against the dequantised experts, loosely; and their sm_90 compilation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from tandem.model.kernels.fp8 import (
    FP8_DTYPE,
    dequantize_fp8_block,
    dequantize_gate_up,
    quantize_activation_groups,
    quantize_fp8_block,
)
from tandem.model.kernels.moe import ExpertScales, fused_experts_torch
from tandem.model.kernels.moe_experts_fp8_triton import (
    QUANT_BLOCK_M,
    QUANT_NUM_WARPS,
    QuantizedRows,
    group_tile,
)
from tandem.model.kernels.moe_experts_triton import (
    align_pairs_to_blocks,
    fused_experts_triton,
    launch_fused_experts,
    padded_row_count,
    pick_expert_blocks,
)
from tests.model.kernels.test_moe_experts import CUOBJDUMP, REPO_ROOT

Experts = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def _fp8_experts(
    num_local: int, hidden: int, inter: int, block: tuple[int, int], gen: torch.Generator
) -> Experts:
    """``(w_gate_up, w_down, gate_up scales, down scales)``, gate and up quantised apart."""
    w13, w2, s13, s2 = [], [], [], []
    for _ in range(num_local):
        gate, sg = quantize_fp8_block(torch.randn(inter, hidden, generator=gen) / hidden**0.5, block)
        up, su = quantize_fp8_block(torch.randn(inter, hidden, generator=gen) / hidden**0.5, block)
        down, sd = quantize_fp8_block(torch.randn(hidden, inter, generator=gen) / inter**0.5, block)
        w13.append(torch.cat([gate, up]))
        s13.append(torch.cat([sg, su]))
        w2.append(down)
        s2.append(sd)
    return torch.stack(w13), torch.stack(w2), torch.stack(s13), torch.stack(s2)


def _batch(
    num_tokens: int, hidden: int, top_k: int, num_experts: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    picks = torch.rand(num_tokens, num_experts, generator=gen).argsort(dim=1)[:, :top_k]
    return x, 0.2 + torch.rand(num_tokens, top_k, generator=gen), picks


# hidden, inter, block: I and D not multiples of the block, blocks of 24 (no power of two)
SHAPES = [(64, 32, (32, 32)), (200, 96, (16, 32)), (72, 40, (24, 24))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("hidden", "inter", "block"), SHAPES)
def test_quant_kernels_match_the_emulation(
    dtype: torch.dtype, hidden: int, inter: int, block: tuple[int, int]
) -> None:
    """This rank holds experts 2..7 of 10; token 0 has none of them and gets a zero row."""
    gen = torch.Generator().manual_seed(hidden + inter)
    first_expert, num_local, top_k = 2, 6, 3
    w13, w2, s13, s2 = _fp8_experts(num_local, hidden, inter, block, gen)
    x, weights, ids = _batch(29, hidden, top_k, 10, dtype, gen)
    ids[0] = torch.tensor([0, 1, 9])
    quant = ExpertScales(s13, s2, block, "quant")
    got = fused_experts_triton(x, weights, ids, w13, w2, first_expert, quant)
    emulated = fused_experts_torch(x, weights, ids, w13, w2, first_expert, quant)
    assert got.dtype == dtype and got.shape == x.shape and not torch.isnan(got).any()
    assert (got[0] == 0).all()
    top = emulated.float().abs().max()
    # float32: only the summation order differs. bfloat16: y and the sum are rounded (the
    # interpreter truncates), as the dequant path's tolerance allows
    tol = 1e-5 if dtype == torch.float32 else 1.5e-2
    assert float((got.float() - emulated.float()).abs().max() / top) < tol

    # against the exact (dequantised) experts: FP8 activations cost a few percent, no more
    dequant = ExpertScales(s13, s2, block, "dequant")
    exact = fused_experts_torch(x.float(), weights, ids, w13, w2, first_expert, dequant)
    assert float((got.float() - exact).norm() / exact.norm()) < 0.08
    assert float(F.cosine_similarity(got.float().flatten(), exact.flatten(), dim=0)) > 0.995
    assert not torch.allclose(got.float(), exact, rtol=1e-3, atol=1e-3)


def test_emulation_is_quantised_activations_times_dequantised_weights() -> None:
    """The emulation, written out the long way: ``x`` and ``h`` quantised and dequantised per
    group, the weights dequantised, plain float32 products."""
    hidden, inter, block = 72, 40, (16, 24)
    gen = torch.Generator().manual_seed(1)
    w13, w2, s13, s2 = _fp8_experts(3, hidden, inter, block, gen)
    x, weights, ids = _batch(11, hidden, 2, 3, torch.float32, gen)

    def fake_quant(v: torch.Tensor) -> torch.Tensor:
        q, s = quantize_activation_groups(v, block[1])
        return q.float() * s.repeat_interleave(block[1], dim=1)[:, : v.shape[1]]

    want = torch.zeros_like(x)
    for e in range(3):
        tokens, slot = torch.where(ids == e)
        gate, up = F.linear(fake_quant(x[tokens]), dequantize_gate_up(w13[e], s13[e], block)).chunk(2, -1)
        y = F.linear(fake_quant(F.silu(gate) * up), dequantize_fp8_block(w2[e], s2[e], block))
        want.index_add_(0, tokens, y * weights[tokens, slot, None])
    got = fused_experts_torch(x, weights, ids, w13, w2, 0, ExpertScales(s13, s2, block, "quant"))
    assert float((got - want).abs().max() / want.abs().max()) < 1e-5


def test_empty_batch() -> None:
    gen = torch.Generator().manual_seed(2)
    w13, w2, s13, s2 = _fp8_experts(4, 64, 32, (32, 32), gen)
    x = torch.empty(0, 64, dtype=torch.bfloat16)
    ids, weights = torch.empty(0, 2, dtype=torch.int64), torch.empty(0, 2)
    out = fused_experts_triton(x, weights, ids, w13, w2, 0, ExpertScales(s13, s2, (32, 32), "quant"))
    assert out.shape == (0, 64) and out.dtype == torch.bfloat16


def test_writes_every_row_of_a_used_block() -> None:
    """Buffers start as NaN: every quantised ``h`` row of a used block (padding rows included, the
    down kernel reads them) gets its values and scales, every local pair's ``y`` row is written."""
    hidden, inter, block = 64, 40, (16, 32)
    gen = torch.Generator().manual_seed(3)
    first_expert, num_local = 4, 8
    w13, w2, s13, s2 = _fp8_experts(num_local, hidden, inter, block, gen)
    x, weights, ids = _batch(23, hidden, 4, 16, torch.float32, gen)
    scales = ExpertScales(s13, s2, block, "quant")
    blocks = pick_expert_blocks(ids.numel(), num_local, hidden, inter, x.dtype)
    blocks = replace(blocks, block_m=QUANT_BLOCK_M, num_warps=QUANT_NUM_WARPS)
    max_rows = padded_row_count(ids.numel(), num_local, blocks.block_m)
    h = QuantizedRows(
        torch.full((max_rows, inter), float("nan")).to(FP8_DTYPE),
        torch.full((max_rows, triton.cdiv(inter, block[1])), float("nan")),
    )
    y = torch.full((ids.numel(), hidden), float("nan"))
    out = torch.full((23, hidden), float("nan"))
    launch_fused_experts(x, weights, ids, w13, w2, first_expert, blocks, h, y, out, scales)
    want = fused_experts_torch(x, weights, ids, w13, w2, first_expert, scales)
    assert float((out - want).abs().max() / want.abs().max()) < 1e-5
    aligned = align_pairs_to_blocks(ids, first_expert, num_local, blocks.block_m)
    used_rows = (aligned.block_expert >= 0).repeat_interleave(blocks.block_m)
    assert not torch.isnan(h.q[used_rows].float()).any() and not torch.isnan(h.scale[used_rows]).any()
    local = ids.flatten() - first_expert
    assert not torch.isnan(y[(local >= 0) & (local < num_local)]).any()


def test_mode_follows_the_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    """``TANDEM_FP8_ACTIVATIONS``, read by ``fp8_mode`` when the scales are made, picks the mode."""
    gen = torch.Generator().manual_seed(4)
    w13, w2, s13, s2 = _fp8_experts(2, 64, 32, (32, 32), gen)
    x, weights, ids = _batch(5, 64, 1, 2, torch.float32, gen)
    got = {}
    for mode in ("dequant", "quant"):
        monkeypatch.setenv("TANDEM_FP8_ACTIVATIONS", mode)
        scales = ExpertScales(s13, s2, (32, 32))
        assert scales.mode == mode
        got[mode] = fused_experts_triton(x, weights, ids, w13, w2, 0, scales)
        want = fused_experts_torch(x, weights, ids, w13, w2, 0, ExpertScales(s13, s2, (32, 32), mode))
        assert float((got[mode] - want).abs().max() / want.abs().max()) < 1e-5
    assert not torch.allclose(got["dequant"], got["quant"], rtol=1e-3, atol=1e-3)
    monkeypatch.setenv("TANDEM_FP8_ACTIVATIONS", "fp4")
    with pytest.raises(ValueError, match="TANDEM_FP8_ACTIVATIONS"):
        ExpertScales(s13, s2, (32, 32))


def _sm90_compile(
    kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], aligned: list[str], num_warps: int
) -> tuple[int, bool]:
    """``kernel`` compiled for sm_90 with no GPU present (as ``test_moe_experts`` does): ptxas's
    stack bytes (register spills), and whether its PTX multiplies e4m3 by e4m3 on tensor cores."""
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    full = {name: "constexpr" if name in constexprs else signature[name] for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    compiled = triton.compile(
        ASTSource(fn, full, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": 3},
    )
    ptx = compiled.asm["ptx"]
    fp8_mma = any("e4m3.e4m3" in line and "mma" in line for line in ptx.splitlines())
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [str(CUOBJDUMP), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    return int(usage.split("STACK:")[1].split()[0]), fp8_mma


def deepseek_v3_quant_expert_builds() -> dict[str, tuple[int, bool]]:
    """``(spill bytes, FP8 MMA)`` of each quant-mode kernel at DeepSeek-V3 expert shapes (D=7168,
    I=2048, 256 local experts, top 8, 128x128 blocks, bfloat16 activations) with the blocks a
    decode batch (64 tokens) and a prefill chunk (4096) pick."""
    from tandem.model.kernels.fp8_gemm_triton import _quantize_groups_kernel
    from tandem.model.kernels.moe_experts_fp8_triton import _down_quant_kernel, _gate_up_silu_quant_kernel

    hidden, inter, num_local, top_k, bi = 7168, 2048, 256, 8, 128
    builds = {}
    for num_tokens in (64, 4096):
        blocks = pick_expert_blocks(num_tokens * top_k, num_local, hidden, inter, torch.bfloat16)
        blocks = replace(blocks, block_m=QUANT_BLOCK_M, num_warps=QUANT_NUM_WARPS)
        shared: dict[str, Any] = {"SCALE_BO": 128, "SCALE_BI": bi, "UPCAST": False, "BLOCK_M": blocks.block_m}
        shared |= {"BLOCK_G": group_tile(bi)}
        rows = dict.fromkeys(["sorted_pair_ids_ptr", "block_expert_ptr"], "*i32")
        ints = ["num_pairs", "hidden", "inter", "w_stride_e", "w_stride_n", "s_stride_e", "s_stride_n"]

        sig = {"xq_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
        sig |= {"hq_ptr": "*fp8e4nv", "hs_ptr": "*fp32"} | rows
        sig |= dict.fromkeys([*ints, "xq_stride_t", "xs_stride_t", "hq_stride_m", "hs_stride_m"], "i32")
        consts = {"TOP_K": top_k, "FP8_MAX_": 448.0, "ROUND_FIRST": False, **shared}
        # scale rows hold 56 columns (D) and 16 (I): not multiples of 16
        odd = ("num_pairs", "s_stride_n", "xs_stride_t", "hs_stride_m")
        aligned = [name for name in sig if name not in odd]
        builds[f"gate_up/{num_tokens}"] = _sm90_compile(
            _gate_up_silu_quant_kernel, sig, consts, aligned, blocks.num_warps
        )

        sig = {"hq_ptr": "*fp8e4nv", "hs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
        sig |= {"y_ptr": "*bf16", "topk_weights_ptr": "*fp32"} | rows
        sig |= dict.fromkeys([*ints, "hq_stride_m", "hs_stride_m", "y_stride_p"], "i32")
        consts = {**shared, "BLOCK_N": blocks.down_block_n}
        aligned = [name for name in sig if name != "num_pairs"]
        builds[f"down/{num_tokens}"] = _sm90_compile(
            _down_quant_kernel, sig, consts, aligned, blocks.num_warps
        )

    sig = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "s_ptr": "*fp32"}
    sig |= dict.fromkeys(["cols", "x_stride", "q_stride", "s_stride"], "i32")
    consts = {"FP8_MAX_": 448.0, "GROUP": bi, "GROUP_PAD": bi, "ROUND_FIRST": False}
    spills, _ = _sm90_compile(_quantize_groups_kernel, sig, consts, ["x_ptr", "q_ptr", "s_ptr", "cols"], 4)
    builds["quantize_x"] = (spills, True)  # no dot to look for
    return builds


def test_quant_kernels_compile_for_h200_with_fp8_dots_and_no_spills() -> None:
    """In a child process without ``TRITON_INTERPRET``, as ``test_moe_experts`` compiles."""
    if not CUOBJDUMP.exists():
        pytest.skip("Triton's NVIDIA tools are not installed")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = (
        "import json; from tests.model.kernels.test_moe_experts_fp8 import "
        "deepseek_v3_quant_expert_builds as f; print(json.dumps(f()))"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert child.returncode == 0, child.stderr[-3000:]
    builds = json.loads(child.stdout.splitlines()[-1])
    assert len(builds) == 5, builds
    assert all(spills == 0 and fp8_mma for spills, fp8_mma in builds.values()), builds


def test_gpu_check_lists_both_fp8_expert_modes() -> None:
    """``bench/gpu_check.py``'s FP8 expert rows at tiny shapes (its GPU run uses DeepSeek-V3's)."""
    from tandem.bench.gpu_check import TINY, check_fp8_experts
    from tandem.model.kernels.registry import get_backend
    from tandem.model.kernels.roofline import PEAKS

    gen = torch.Generator().manual_seed(5)
    x, weights, ids = _batch(TINY.moe_tokens, TINY.hidden, TINY.top_k, TINY.experts, torch.float32, gen)
    rows = check_fp8_experts(TINY, get_backend("cpu", "triton"), torch.device("cpu"), x, weights, ids)
    assert [row.kernel for row in rows] == ["moe_experts_fp8_dequant", "moe_experts_fp8_quant"]
    assert all(row.max_rel_err < 1e-5 for row in rows), rows
    # the quant row is held against the FP8 peak, with its target; dequant's against bf16
    assert rows[1].fp8 and not rows[0].fp8 and (rows[0].target, rows[1].target) == (None, 0.5)
    peaks = PEAKS["H200"]
    assert rows[1].cells(peaks)[3].endswith("FP8") and rows[1].cells(peaks)[5].startswith("0.50: ")
