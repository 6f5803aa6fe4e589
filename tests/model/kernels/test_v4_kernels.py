"""DeepSeek-V4's Triton kernels (sparse attention with sinks, the indexer's scores and top-k, the
compressor's pool) against their torch references, in Triton's interpreter on CPU.

Key rows no index names hold NaN, so a kernel that reads a key it was not given fails; the
indexer's cases put exact ties (every head clipped: score 0.0, and -0.0) across the top-k
boundary, so a top-k that does not give them to the lowest index fails."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tandem.model.kernels.v4_attention import (
    compress_windows_torch,
    indexer_topk_torch,
    sparse_attention_torch,
)
from tandem.model.kernels.v4_attention_triton import sparse_attention_triton
from tandem.model.kernels.v4_compress_triton import compress_windows_triton
from tandem.model.kernels.v4_indexer_triton import indexer_topk_triton, order_keys, select_topk_triton

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.float() - ref.float()).abs().max() / ref.float().abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sparse_attention_matches_the_reference_and_reads_only_named_keys(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    tokens, heads, dim, keys, width = 7, 20, 48, 90, 37  # heads over one block, width over one tile
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    kv = torch.randn(keys, dim, generator=gen).to(dtype)
    sink = torch.randn(heads, generator=gen)
    indices = torch.randint(0, keys // 2, (tokens, width), generator=gen, dtype=torch.int32)
    indices[torch.rand(tokens, width, generator=gen) < 0.3] = -1
    indices[2] = -1  # a row that sees nothing: everything goes to the sink, the output is 0
    kv[keys // 2 :] = float("nan")  # never named
    ref = sparse_attention_torch(q, kv, indices, sink, dim**-0.5)
    out = sparse_attention_triton(q, kv, indices, sink, dim**-0.5)
    assert out.dtype == dtype and not out.isnan().any()
    assert _rel(out, ref) < TOL[dtype]
    assert out[2].abs().max() == 0
    # the sink takes probability: without it (a very negative logit) the output differs
    assert _rel(sparse_attention_triton(q, kv, indices, sink - 1e4, dim**-0.5), out) > 1e-3


def _indexer_case(
    gen: torch.Generator, counts: list[list[int]], heads: int = 3, dim: int = 16
) -> tuple[torch.Tensor, ...]:
    """Requests with rows seeing ``counts[r]`` entries each; a third of every request's keys are
    orthogonal to every query's heads after the ReLU (negative dot products): their scores tie
    at 0.0 or -0.0 (negative weights)."""
    rows = sum(len(c) for c in counts)
    q = torch.randn(rows, heads, dim, generator=gen).abs()
    weights = torch.randn(rows, heads, generator=gen)
    parts, starts, at = [], [], 0
    for request in counts:
        width = max(request, default=0) + 2
        k = torch.randn(width, dim, generator=gen)
        k[torch.arange(width) % 3 == 0] = -k[torch.arange(width) % 3 == 0].abs()  # clipped by every head
        parts.append(k)
        starts += [at] * len(request)
        at += width
    flat = [n for request in counts for n in request]
    return q, weights, torch.cat(parts), torch.tensor(starts), torch.tensor(flat)


@pytest.mark.parametrize("k", [1, 4, 9])
def test_indexer_topk_matches_the_reference_with_ties_at_the_boundary(k: int) -> None:
    gen = torch.Generator().manual_seed(k)
    # a prefill chunk (rows seeing 0 .. 12 entries), a decode row and a long row
    q, w, keys, starts, counts = _indexer_case(gen, [[0, 1, 3, 5, 8, 12], [7], [40]])
    most = int(counts.max())
    ref = indexer_topk_torch(q, w, keys, starts, counts, most, k, 0.25)
    out = indexer_topk_triton(q, w, keys, starts, counts, most, k, 0.25)
    assert out.dtype == torch.int32 and out.shape == (len(counts), k)
    assert torch.equal(out, ref)
    assert (out[0] == -1).all()  # a row that sees no entry picks none


def test_the_select_gives_ties_to_the_lowest_index_and_counts_minus_zero_as_zero() -> None:
    scores = torch.tensor(
        [
            [0.0, 3.0, -0.0, 0.0, -1.0, 0.0, 2.0, -0.0],  # 2 above zero, five zeros tie for 3 slots
            [-0.0, 0.0, -0.0, 0.0, 0.0, 0.0, 0.0, 0.0],  # all tie: the first five
            [5.0, 4.0, 3.0, 2.0, 1.0, 0.5, 0.25, 0.125],  # only 3 visible: all of them
        ]
    )
    out = select_topk_triton(order_keys(scores), torch.tensor([8, 8, 3], dtype=torch.int32), 5)
    assert out.tolist() == [[0, 1, 2, 3, 6], [0, 1, 2, 3, 4], [0, 1, 2, -1, -1]]


@pytest.mark.parametrize(("overlap", "has_prev"), [(True, True), (True, False), (False, False)])
def test_compress_windows_matches_the_reference(overlap: bool, has_prev: bool) -> None:
    """CSA's overlapping windows after an earlier call and from the first, HCA's plain ones."""
    gen = torch.Generator().manual_seed(1)
    windows, rate, dim = 5, 4, 24
    width = 2 * dim if overlap else dim
    kv, gate = (
        torch.randn(windows, rate, width, generator=gen),
        torch.randn(windows, rate, width, generator=gen),
    )
    ape, norm = torch.randn(rate, width, generator=gen), 1 + 0.1 * torch.randn(dim, generator=gen)
    prev = (
        (torch.randn(rate, dim, generator=gen), torch.randn(rate, dim, generator=gen))
        if has_prev
        else (None, None)
    )
    ref = compress_windows_torch(kv, gate, ape, norm, 1e-6, overlap, *prev)
    out = compress_windows_triton(kv, gate, ape, norm, 1e-6, overlap, *prev)
    assert out.shape == (windows, dim) and _rel(out, ref) < 1e-5


def v4_flash_spill_bytes() -> dict[str, int]:
    """Spill bytes of each V4 kernel compiled for sm_90 at V4-Flash shapes (bfloat16; heads of
    512, the indexer's 64 heads of 128), as the wrappers launch them."""
    import triton.language as tl

    from tandem.model.kernels import v4_attention_triton as attn
    from tandem.model.kernels import v4_compress_triton as comp
    from tandem.model.kernels import v4_indexer_triton as idx
    from tests.model.kernels.test_moe_experts import _sm90_spill_bytes

    spills = {}
    sig = {"q_ptr": "*bf16", "kv_ptr": "*bf16", "idx_ptr": "*i32", "sink_ptr": "*fp32", "out_ptr": "*bf16"}
    ints = ["num_heads", "head_dim", "num_idx", "stride_q_t", "stride_q_h", "stride_kv", "stride_idx"]
    sig |= {"scale_log2": "fp32"} | dict.fromkeys([*ints, "stride_o_t", "stride_o_h"], "i32")
    consts = {"BLOCK_H": attn.BLOCK_H, "BLOCK_N": attn.BLOCK_N, "BLOCK_D": 512}
    consts |= {"DOT_DTYPE": tl.bfloat16, "DOT_PRECISION": "tf32"}
    aligned = ["q_ptr", "kv_ptr", "idx_ptr", "out_ptr", "stride_q_t", "stride_q_h", "stride_kv", "stride_o_t"]
    spills["sparse_attention"] = _sm90_spill_bytes(attn._sparse_attention_kernel, sig, consts, aligned, 4)

    sig = {
        "q_ptr": "*bf16",
        "w_ptr": "*fp32",
        "keys_ptr": "*bf16",
        "starts_ptr": "*i32",
        "counts_ptr": "*i32",
    }
    sig |= {"scores_ptr": "*i32", "scale": "fp32"} | dict.fromkeys(
        ["num_heads", "head_dim", "stride_q_t", "stride_q_h", "stride_w", "stride_keys", "stride_s"], "i32"
    )
    consts = {
        "BLOCK_H": 64,
        "BLOCK_E": idx.BLOCK_E,
        "BLOCK_D": 128,
        "DOT_DTYPE": tl.bfloat16,
        "DOT_PRECISION": "tf32",
    }
    spills["indexer_scores"] = _sm90_spill_bytes(
        idx._indexer_scores_kernel, sig, consts, ["q_ptr", "keys_ptr"], 4
    )
    sig = {"scores_ptr": "*i32", "counts_ptr": "*i32", "out_ptr": "*i32", "k": "i32", "stride_s": "i32"}
    sig |= {"stride_o": "i32"}
    consts = {"BLOCK": idx.BLOCK_SELECT, "BLOCK_K": idx.BLOCK_SELECT}
    spills["indexer_select"] = _sm90_spill_bytes(
        idx._select_kernel, sig, consts, ["scores_ptr", "out_ptr"], 4
    )

    sig = dict.fromkeys(
        ["kv_ptr", "gate_ptr", "ape_ptr", "prev_kv_ptr", "prev_gate_ptr", "norm_ptr", "out_ptr"], "*fp32"
    )
    sig |= {"rate": "i32", "dim": "i32", "width": "i32", "eps": "fp32"}
    consts = {"OVERLAP": True, "HAS_PREV": True, "BLOCK_D": 512}
    spills["compress"] = _sm90_spill_bytes(comp._compress_kernel, sig, consts, ["kv_ptr", "gate_ptr"], 4)
    return spills


def test_the_v4_kernels_compile_for_h200_without_spills() -> None:
    from tests.model.kernels.test_moe_experts import CUOBJDUMP, REPO_ROOT

    if not CUOBJDUMP.exists():
        pytest.skip("Triton's NVIDIA tools are not installed")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = (
        "import json; from tests.model.kernels.test_v4_kernels import v4_flash_spill_bytes as f; "
        "print(json.dumps(f()))"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert child.returncode == 0, child.stderr[-3000:]
    spills = json.loads(child.stdout.splitlines()[-1])
    assert len(spills) == 4 and not any(spills.values()), spills
