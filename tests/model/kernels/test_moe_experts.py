"""The fused-experts kernels against ``fused_experts_torch`` (Triton's interpreter on CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from tandem.model.kernels.moe import fused_experts_torch, grouped_topk_torch
from tandem.model.kernels.moe_experts_triton import (
    ExpertBlocks,
    ExpertDtypeMismatch,
    _down_kernel,
    _gate_up_silu_kernel,
    _sum_local_pairs_kernel,
    align_pairs_to_blocks,
    fused_experts_triton,
    launch_fused_experts,
    padded_row_count,
    pick_expert_blocks,
)

# (rtol, atol as a share of the largest reference value). Triton's interpreter truncates
# float32 -> bfloat16 where a GPU rounds to nearest, and h, each pair's output and the sum are
# each rounded once, so bfloat16 needs more than one ulp (2^-8 relative) of room.
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 2e-3), torch.bfloat16: (2e-2, 1e-2)}
HIDDEN, INTER = 64, 32  # the tiny test model
REPO_ROOT = Path(__file__).resolve().parents[3]
CUOBJDUMP = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"


def _experts(
    num_local: int, hidden: int, inter: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    w_gate_up = torch.randn(num_local, 2 * inter, hidden, generator=gen) / hidden**0.5
    w_down = torch.randn(num_local, hidden, inter, generator=gen) / inter**0.5
    return w_gate_up.to(dtype), w_down.to(dtype)


def _route(
    num_tokens: int, num_experts: int, n_group: int, topk_group: int, top_k: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = 2 * torch.randn(num_tokens, num_experts, generator=gen)
    bias = 0.3 * torch.randn(num_experts, generator=gen)
    return grouped_topk_torch(logits, bias, top_k, n_group, topk_group, True, 2.5)


def _distinct_ids(num_tokens: int, top_k: int, choices: list[int], gen: torch.Generator) -> torch.Tensor:
    """Per token ``top_k`` distinct experts drawn from ``choices``."""
    pool = torch.tensor(choices)
    picks = torch.rand(num_tokens, len(choices), generator=gen).argsort(dim=1)[:, :top_k]
    return pool[picks]


def _weights(num_tokens: int, top_k: int, gen: torch.Generator) -> torch.Tensor:
    return 0.2 + torch.rand(num_tokens, top_k, generator=gen)


def _check(
    x: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    first_expert: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    if out is None:
        out = fused_experts_triton(x, weights, ids, w_gate_up, w_down, first_expert)
    ref = fused_experts_torch(x, weights, ids, w_gate_up, w_down, first_expert)
    assert out.shape == ref.shape and out.dtype == x.dtype
    assert not torch.isnan(out).any()
    rtol, atol = TOL[x.dtype]
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol * scale)
    return out


def test_align_layout_of_the_docstring() -> None:
    aligned = align_pairs_to_blocks(torch.tensor([[2, 0], [0, 3], [5, 0]]), 0, 4, block_m=4)
    pad = 6
    assert aligned.sorted_pair_ids.tolist() == [1, 2, 5, pad, 0, pad, pad, pad, 3, pad, pad, pad] + [pad] * 8
    assert aligned.block_expert.tolist() == [0, 2, 3, -1, -1]


@pytest.mark.parametrize("first_expert,num_local", [(0, 16), (5, 6)])
def test_align_invariants(first_expert: int, num_local: int) -> None:
    """Each local pair sits in exactly one row, in a block of its own expert, in token order."""
    gen = torch.Generator().manual_seed(first_expert)
    ids = _distinct_ids(45, 4, list(range(16)), gen)
    block_m = 8
    aligned = align_pairs_to_blocks(ids, first_expert, num_local, block_m)
    rows = aligned.sorted_pair_ids.long()
    assert rows.numel() == padded_row_count(ids.numel(), num_local, block_m)
    real = rows < ids.numel()
    local = ids.flatten() - first_expert
    expected = torch.nonzero((local >= 0) & (local < num_local)).flatten()
    assert sorted(rows[real].tolist()) == expected.tolist()
    row_expert = aligned.block_expert.long().repeat_interleave(block_m)
    assert (local[rows[real]] == row_expert[real]).all()
    for expert in range(num_local):
        pairs = rows[real & (row_expert == expert)]
        assert pairs.tolist() == sorted(pairs.tolist())
    used = aligned.block_expert >= 0
    assert used.sum() == sum(-(-int((local == e).sum()) // block_m) for e in range(num_local))
    assert used[: int(used.sum())].all(), "spare blocks come last"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "num_tokens,num_experts,n_group,topk_group,top_k",
    [(1, 16, 4, 2, 4), (37, 16, 4, 2, 4), (37, 8, 2, 1, 3)],
)
def test_tiny_models(
    dtype: torch.dtype, num_tokens: int, num_experts: int, n_group: int, topk_group: int, top_k: int
) -> None:
    gen = torch.Generator().manual_seed(num_tokens * num_experts)
    x = torch.randn(num_tokens, HIDDEN, generator=gen).to(dtype)
    weights, ids = _route(num_tokens, num_experts, n_group, topk_group, top_k, gen)
    w_gate_up, w_down = _experts(num_experts, HIDDEN, INTER, dtype, gen)
    _check(x, weights, ids, w_gate_up, w_down, 0)


@pytest.mark.parametrize("num_tokens,block_m", [(120, 32), (300, 64)])
def test_many_tokens_use_taller_blocks(num_tokens: int, block_m: int) -> None:
    gen = torch.Generator().manual_seed(2)
    assert pick_expert_blocks(num_tokens * 4, 16, HIDDEN, INTER, torch.float32).block_m == block_m
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    weights, ids = _route(num_tokens, 16, 4, 2, 4, gen)
    w_gate_up, w_down = _experts(16, HIDDEN, INTER, torch.float32, gen)
    _check(x, weights, ids, w_gate_up, w_down, 0)


def test_float16() -> None:
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(21, HIDDEN, generator=gen).half()
    weights, ids = _route(21, 16, 4, 2, 4, gen)
    w_gate_up, w_down = _experts(16, HIDDEN, INTER, torch.float16, gen)
    _check(x, weights, ids, w_gate_up, w_down, 0)


def test_experts_without_tokens_and_one_crowded_expert() -> None:
    """Experts 0, 5 and 15 get nothing; expert 3 gets every token (several blocks of one expert)."""
    gen = torch.Generator().manual_seed(4)
    num_tokens, top_k = 40, 4
    others = _distinct_ids(num_tokens, top_k - 1, [e for e in range(16) if e not in (0, 3, 5, 15)], gen)
    ids = torch.cat([torch.full((num_tokens, 1), 3), others], dim=1)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    w_gate_up, w_down = _experts(16, HIDDEN, INTER, torch.float32, gen)
    _check(x, _weights(num_tokens, top_k, gen), ids, w_gate_up, w_down, 0)


@pytest.mark.parametrize(
    "dtype,hidden,inter",
    [(torch.float32, HIDDEN, INTER), (torch.bfloat16, HIDDEN, INTER), (torch.float32, 200, 96)],
)
def test_expert_parallel_slice(dtype: torch.dtype, hidden: int, inter: int) -> None:
    """This rank holds experts 6..10 of 16: other pairs add nothing, a token with none is zero.
    200 x 96 takes several masked reduction steps and a partial column block."""
    gen = torch.Generator().manual_seed(5)
    num_tokens, top_k, first_expert, num_local = 29, 4, 6, 5
    ids = _distinct_ids(num_tokens, top_k, list(range(16)), gen)
    ids[0] = torch.tensor([0, 1, 12, 15])  # nothing local
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    w_gate_up, w_down = _experts(num_local, hidden, inter, dtype, gen)
    out = _check(x, _weights(num_tokens, top_k, gen), ids, w_gate_up, w_down, first_expert)
    assert (out[0] == 0).all()


def test_writes_every_output_element() -> None:
    """Buffers start as NaN: every output element, every h row of a used block and every pair row
    of a local expert is written; rows of non-local pairs stay unread."""
    gen = torch.Generator().manual_seed(6)
    num_tokens, top_k, first_expert, num_local = 23, 4, 4, 8
    ids = _distinct_ids(num_tokens, top_k, list(range(16)), gen)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    weights = _weights(num_tokens, top_k, gen)
    w_gate_up, w_down = _experts(num_local, HIDDEN, INTER, torch.float32, gen)
    blocks = ExpertBlocks(
        block_m=16, gate_up_block_n=16, gate_up_block_k=32, down_block_n=32, down_block_k=16
    )
    max_rows = padded_row_count(ids.numel(), num_local, blocks.block_m)
    h = torch.full((max_rows, INTER), float("nan"))
    y = torch.full((ids.numel(), HIDDEN), float("nan"))
    out = torch.full((num_tokens, HIDDEN), float("nan"))
    launch_fused_experts(x, weights, ids, w_gate_up, w_down, first_expert, blocks, h, y, out)
    _check(x, weights, ids, w_gate_up, w_down, first_expert, out=out)
    aligned = align_pairs_to_blocks(ids, first_expert, num_local, blocks.block_m)
    used_rows = (aligned.block_expert >= 0).repeat_interleave(blocks.block_m)
    assert not torch.isnan(h[used_rows]).any()
    local = ids.flatten() - first_expert
    assert not torch.isnan(y[(local >= 0) & (local < num_local)]).any()


def test_row_strided_activations() -> None:
    gen = torch.Generator().manual_seed(7)
    base = torch.randn(13, HIDDEN + 16, generator=gen)
    x = base[:, 8 : 8 + HIDDEN]
    weights, ids = _route(13, 16, 4, 2, 4, gen)
    w_gate_up, w_down = _experts(16, HIDDEN, INTER, torch.float32, gen)
    _check(x, weights, ids, w_gate_up, w_down, 0)


def test_rejects_mixed_dtypes() -> None:
    gen = torch.Generator().manual_seed(8)
    weights, ids = _route(2, 16, 4, 2, 4, gen)
    w_gate_up, w_down = _experts(16, HIDDEN, INTER, torch.bfloat16, gen)
    with pytest.raises(ExpertDtypeMismatch):
        fused_experts_triton(torch.randn(2, HIDDEN, generator=gen), weights, ids, w_gate_up, w_down, 0)


@pytest.mark.kernels_full
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 17, 300])
@pytest.mark.parametrize(
    "hidden,inter,num_experts,first_expert,num_local,top_k",
    [
        (64, 32, 16, 0, 16, 4),
        (64, 32, 8, 0, 8, 3),
        (200, 96, 16, 4, 8, 4),  # dims not powers of two, expert-parallel slice
        (256, 128, 32, 16, 16, 8),
    ],
)
def test_full_grid(
    dtype: torch.dtype,
    num_tokens: int,
    hidden: int,
    inter: int,
    num_experts: int,
    first_expert: int,
    num_local: int,
    top_k: int,
) -> None:
    gen = torch.Generator().manual_seed(num_tokens + hidden)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    ids = _distinct_ids(num_tokens, top_k, list(range(num_experts)), gen)
    w_gate_up, w_down = _experts(num_local, hidden, inter, dtype, gen)
    _check(x, _weights(num_tokens, top_k, gen), ids, w_gate_up, w_down, first_expert)


def _sm90_spill_bytes(
    kernel: Any, signature: dict[str, str], constexprs: dict[str, Any], aligned: list[str], num_warps: int
) -> int:
    """Compile ``kernel`` for an H200 (sm_90) with no GPU present, specialised as a launch would
    be (``aligned`` arguments divisible by 16, unit strides constant), and return the stack bytes
    ptxas gave it: register spills."""
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    full = {name: "constexpr" if name in constexprs else signature[name] for name in fn.arg_names}
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    compiled = triton.compile(
        ASTSource(fn, full, constexprs, attrs),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": num_warps, "num_stages": 3},
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [str(CUOBJDUMP), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    return int(usage.split("STACK:")[1].split()[0])


def deepseek_v3_spill_bytes(dtype: str, fp8_experts: bool = False) -> dict[str, int]:
    """Spill bytes of each kernel at DeepSeek-V3 expert shapes (D=7168, I=2048, 256 local experts,
    top 8) with the blocks a decode batch (64 tokens) and a prefill chunk (4096) pick; with
    ``fp8_experts`` the experts are FP8 with 128x128 block scales, as the release ships them."""
    hidden, inter, num_local, top_k = 7168, 2048, 256, 8
    torch_dtype = torch.bfloat16 if dtype == "bf16" else torch.float32
    w_type = "*fp8e4nv" if fp8_experts else f"*{dtype}"
    scale = {"HAS_SCALE": fp8_experts, "SCALE_BO": 128, "SCALE_BI": 128}
    scale_sig = {"s_ptr": "*fp32", "s_stride_e": "i32", "s_stride_n": "i32"}
    spills = {}
    for num_tokens in (64, 4096):
        blocks = pick_expert_blocks(num_tokens * top_k, num_local, hidden, inter, torch_dtype)
        precision = "ieee" if dtype == "fp32" else "tf32"
        shared: dict[str, Any] = {"DOT_PRECISION": precision, "UPCAST_DOT": False, "BLOCK_M": blocks.block_m}
        ints = ["num_pairs", "hidden", "inter"]
        sig = dict.fromkeys(["x_ptr", "h_ptr"], f"*{dtype}") | {"w_ptr": w_type} | scale_sig
        sig |= dict.fromkeys(["sorted_pair_ids_ptr", "block_expert_ptr"], "*i32")
        sig |= dict.fromkeys([*ints, "x_stride_t", "w_stride_e", "w_stride_n", "h_stride_m"], "i32")
        sig |= {"limit": "fp32"}
        consts = {"x_stride_d": 1, "w_stride_d": 1, "TOP_K": top_k, "CLIP": False, **shared, **scale}
        consts |= {"BLOCK_N": blocks.gate_up_block_n, "BLOCK_K": blocks.gate_up_block_k}
        aligned = [
            name for name in sig if name not in ("num_pairs", "s_stride_n", "limit")
        ]  # 56 scale columns
        spills[f"gate_up/{num_tokens}"] = _sm90_spill_bytes(
            _gate_up_silu_kernel, sig, consts, aligned, blocks.num_warps
        )

        sig = dict.fromkeys(["h_ptr", "y_ptr"], f"*{dtype}") | {"topk_weights_ptr": "*fp32", "w_ptr": w_type}
        sig |= dict.fromkeys(["sorted_pair_ids_ptr", "block_expert_ptr"], "*i32") | scale_sig
        sig |= dict.fromkeys([*ints, "h_stride_m", "w_stride_e", "w_stride_n", "y_stride_p"], "i32")
        consts = {"w_stride_k": 1, **shared, "BLOCK_N": blocks.down_block_n, "BLOCK_K": blocks.down_block_k}
        consts |= scale
        aligned = [name for name in sig if name != "num_pairs"]
        spills[f"down/{num_tokens}"] = _sm90_spill_bytes(_down_kernel, sig, consts, aligned, blocks.num_warps)

    sig = dict.fromkeys(["y_ptr", "out_ptr"], f"*{dtype}") | {"topk_ids_ptr": "*i64"}
    sig |= dict.fromkeys(["hidden", "first_expert", "num_local", "y_stride_p", "out_stride_t"], "i32")
    aligned = ["y_ptr", "out_ptr", "topk_ids_ptr", "hidden", "y_stride_p", "out_stride_t"]
    consts = {"TOP_K": top_k, "BLOCK_D": 1024}
    spills["sum"] = _sm90_spill_bytes(_sum_local_pairs_kernel, sig, consts, aligned, 4)
    return spills


@pytest.mark.parametrize(
    ("dtype", "fp8_experts"),
    [("bf16", False), ("bf16", True), pytest.param("fp32", False, marks=pytest.mark.kernels_full)],
)
def test_compiles_for_h200_without_spills(dtype: str, fp8_experts: bool) -> None:
    """Compiled in a child process without ``TRITON_INTERPRET``: once the interpreter is chosen it
    also takes over Triton's own library functions, which a compilation calls."""
    if not CUOBJDUMP.exists():
        pytest.skip("Triton's NVIDIA tools are not installed")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = (
        "import json; from tests.model.kernels.test_moe_experts import deepseek_v3_spill_bytes as f; "
        f"print(json.dumps(f({dtype!r}, {fp8_experts!r})))"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert child.returncode == 0, child.stderr[-3000:]
    spills = json.loads(child.stdout.splitlines()[-1])
    assert spills and not any(spills.values()), spills


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_clipped_swiglu_matches_the_reference_and_the_clip_bites(dtype: torch.dtype) -> None:
    """DeepSeek-V4's experts: gate clipped from above, up on both sides, before silu(gate) * up.
    At a limit below the gates' and ups' range the clip changes the output (so it is applied)."""
    gen = torch.Generator().manual_seed(11)
    x = (3 * torch.randn(19, HIDDEN, generator=gen)).to(dtype)
    weights, ids = _route(19, 16, 4, 2, 4, gen)
    w_gate_up, w_down = _experts(16, HIDDEN, INTER, dtype, gen)
    limit = 0.7
    out = fused_experts_triton(x, weights, ids, w_gate_up, w_down, 0, swiglu_limit=limit)
    ref = fused_experts_torch(x, weights, ids, w_gate_up, w_down, 0, swiglu_limit=limit)
    rtol, atol = TOL[dtype]
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol * scale)
    unclipped = fused_experts_torch(x, weights, ids, w_gate_up, w_down, 0)
    assert (unclipped.float() - ref.float()).abs().max().item() > 10 * atol * scale
    gate_up = x.float() @ w_gate_up[ids[0, 0]].float().t()  # a row whose clip does something
    assert gate_up.abs().max().item() > limit
