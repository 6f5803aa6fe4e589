"""Triton flash-decoding MLA against ``decode_attention_torch`` (Triton's interpreter on CPU).

Pools are random with shuffled page ids; slots past each request's end, page-table padding and
some pages no request owns hold NaN, so a kernel that reads outside a request's tokens fails.
Every buffer the kernel module allocates (the output and the per-split partials) starts as NaN,
so an element left unwritten, or a partial of an empty split that is read, fails too.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import triton.backends.nvidia

from tandem.model.attention_metadata import AttentionMetadata
from tandem.model.kernels import mla_decode_triton
from tandem.model.kernels.mla_attention import decode_attention_torch
from tandem.model.kernels.mla_decode_triton import (
    BLOCK_H,
    BLOCK_N,
    BLOCK_N_WIDE,
    NUM_WARPS,
    NUM_WARPS_WIDE,
    choose_num_kv_splits,
    decode_attention_splits,
    decode_attention_triton,
)
from tandem.model.kernels.tuning import mla_decode_tiles

LATENT, ROPE, NOPE = 32, 8, 16  # the tiny model's kv_lora_rank, qk_rope_head_dim, qk_nope_head_dim
SCALE = (NOPE + ROPE) ** -0.5
TOL = {
    torch.float64: 1e-6,  # the scale is a float32 kernel argument on a GPU
    torch.float32: 1e-4,
    # a few bfloat16/float16 ulps: softmax weights are rounded to the input dtype before p·c, and
    # Triton's interpreter truncates where torch rounds
    torch.float16: 1e-2,
    torch.bfloat16: 2e-2,
}


class NanTorch:
    """``torch`` as a kernel module sees it, except that ``empty`` buffers are filled with NaN."""

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)

    @staticmethod
    def empty(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = torch.empty(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out

    @staticmethod
    def empty_like(*args: Any, **kwargs: Any) -> torch.Tensor:
        out = torch.empty_like(*args, **kwargs)
        return out.fill_(float("nan")) if out.is_floating_point() else out


@pytest.fixture(autouse=True)
def _poison_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(mla_decode_triton, "torch", NanTorch())


def paged_batch(
    seq_lens: list[int], page_size: int, dtype: torch.dtype, gen: torch.Generator, spare_pages: int = 4
) -> tuple[torch.Tensor, list[list[int]], int]:
    """A random pool ``[pages, page_size, L+R]``, each request's pages (shuffled) and a NaN page.

    Page 0, which masked page-table loads fall back to, belongs to no request and is NaN, as
    are the slots past each request's end and half the other pages nobody owns; the NaN page
    returned is one of those, to pad page tables with.
    """
    needed = [math.ceil(s / page_size) for s in seq_lens]
    order = (1 + torch.randperm(sum(needed) + spare_pages, generator=gen)).tolist()
    page_ids, start = [], 0
    for n in needed:
        page_ids.append(order[start : start + n])
        start += n
    pool = torch.randn(len(order) + 1, page_size, LATENT + ROPE, generator=gen)
    for pages, seq_len in zip(page_ids, seq_lens, strict=True):
        if seq_len % page_size:
            pool[pages[-1], seq_len % page_size :] = float("nan")
    nan_pages = [0, *order[start::2]]
    pool[nan_pages] = float("nan")
    return pool.to(dtype), page_ids, nan_pages[-1]


def build_meta(
    page_size: int, query_lens: list[int], seq_lens: list[int], page_ids: list[list[int]], pad_page: int
) -> AttentionMetadata:
    """Metadata whose page-table padding points at ``pad_page`` rather than 0."""
    meta = AttentionMetadata.build(page_size, query_lens, seq_lens, page_ids)
    for row, pages in enumerate(page_ids):
        meta.page_table[row, len(pages) :] = pad_page
    return meta


def _decode_inputs(
    seq_lens: list[int], heads: int, page_size: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    gen = torch.Generator().manual_seed(seed)
    pool, page_ids, nan_page = paged_batch(seq_lens, page_size, dtype, gen)
    meta = build_meta(page_size, [1] * len(seq_lens), seq_lens, page_ids, nan_page)
    q_latent = torch.randn(len(seq_lens), heads, LATENT, generator=gen).to(dtype)
    q_pe = torch.randn(len(seq_lens), heads, NOPE + ROPE, generator=gen).to(dtype)[..., NOPE:]
    return q_latent, q_pe, pool, meta


def _assert_matches(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert not torch.isnan(out).any()
    tol = TOL[ref.dtype]
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_ragged_batch(dtype: torch.dtype) -> None:
    """Lengths 1, one page, one page + 1 and many pages, one request each."""
    q_latent, q_pe, pool, meta = _decode_inputs([1, 4, 5, 37], heads=4, page_size=4, dtype=dtype, seed=0)
    out = decode_attention_triton(q_latent, q_pe, pool, meta, SCALE)
    _assert_matches(out, decode_attention_torch(q_latent, q_pe, pool, meta, SCALE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_long_request_over_several_splits(dtype: torch.dtype) -> None:
    """70 tokens in 3 tile-aligned splits, the fourth empty; the short requests fill split 0 only."""
    q_latent, q_pe, pool, meta = _decode_inputs([1, 70, 9], heads=4, page_size=4, dtype=dtype, seed=1)
    out = decode_attention_splits(q_latent, q_pe, pool, meta, SCALE, num_kv_splits=4, block_n=16)
    _assert_matches(out, decode_attention_torch(q_latent, q_pe, pool, meta, SCALE))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_with_the_h200_tiles(dtype: torch.dtype) -> None:
    """The tuning table's H200 tiles (64 heads a program) on 80 heads: one full head block and one
    partly masked, two requests over two splits."""
    tiles = mla_decode_tiles(True, "H200")
    assert tiles.block_h == 64
    q_latent, q_pe, pool, meta = _decode_inputs([3, 40], heads=80, page_size=4, dtype=dtype, seed=5)
    out = decode_attention_splits(q_latent, q_pe, pool, meta, SCALE, num_kv_splits=2, tiles=tiles)
    _assert_matches(out, decode_attention_torch(q_latent, q_pe, pool, meta, SCALE))


def test_decode_empty_batch() -> None:
    q_latent, q_pe, pool, _ = _decode_inputs([3], heads=4, page_size=4, dtype=torch.float32, seed=2)
    meta = AttentionMetadata.build(4, [], [], [])
    out = decode_attention_triton(q_latent[:0], q_pe[:0], pool, meta, SCALE)
    assert out.shape == (0, 4, LATENT)


def test_num_kv_splits_follows_length_and_batch() -> None:
    """A long lone request is spread over the GPU; a short one or a full batch is not split."""
    assert choose_num_kv_splits(32768, batch_size=1, num_heads=128, num_sms=132) == 16
    assert choose_num_kv_splits(1000, batch_size=1, num_heads=128, num_sms=132) == 4
    assert choose_num_kv_splits(200, batch_size=1, num_heads=128, num_sms=132) == 1
    assert choose_num_kv_splits(32768, batch_size=64, num_heads=128, num_sms=132) == 2
    assert choose_num_kv_splits(32768, batch_size=512, num_heads=128, num_sms=132) == 1
    assert choose_num_kv_splits(0, batch_size=1, num_heads=4, num_sms=132) == 1


@pytest.mark.kernels_full
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", [4, 20])
@pytest.mark.parametrize(
    "seq_lens,page_size,num_kv_splits,block_n",
    [
        ([1, 8, 9, 200], 8, 1, 32),
        ([1, 8, 9, 200], 8, 3, 16),
        ([300, 2], 8, 16, 16),  # splits of 32 tokens: the short request leaves 15 empty
        ([300, 2], 4, 7, 32),
        ([5] * 6, 4, 2, 16),
    ],
)
def test_decode_full(
    dtype: torch.dtype, heads: int, seq_lens: list[int], page_size: int, num_kv_splits: int, block_n: int
) -> None:
    q_latent, q_pe, pool, meta = _decode_inputs(seq_lens, heads, page_size, dtype, seed=len(seq_lens))
    out = decode_attention_splits(q_latent, q_pe, pool, meta, SCALE, num_kv_splits, block_n)
    _assert_matches(out, decode_attention_torch(q_latent, q_pe, pool, meta, SCALE))


@pytest.mark.kernels_full
def test_decode_full_default_splits_for_a_long_request() -> None:
    """The split heuristic itself: 1100 tokens give 5 splits."""
    q_latent, q_pe, pool, meta = _decode_inputs([1100, 3], heads=4, page_size=8, dtype=torch.float32, seed=9)
    assert choose_num_kv_splits(1100, 2, 4, mla_decode_triton.DEFAULT_NUM_SMS) == 5
    out = decode_attention_triton(q_latent, q_pe, pool, meta, SCALE)
    _assert_matches(out, decode_attention_torch(q_latent, q_pe, pool, meta, SCALE))


DEEPSEEK_LATENT, DEEPSEEK_ROPE, DEEPSEEK_PAGE = 512, 64, 64
SM90_SHARED_BYTES = 227 * 1024

# Runs in a fresh interpreter: where TRITON_INTERPRET=1 was set at import, Triton's own jit
# functions (tl.max, tl.sum) are interpreter-wrapped and cannot be compiled.
_COMPILE_FOR_SM90 = """
import importlib, json, subprocess, sys, tempfile
from pathlib import Path
import triton, triton.backends.nvidia, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

cuobjdump = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"
results = []
for spec in json.loads(sys.argv[1]):
    fn = getattr(importlib.import_module(spec["module"]), spec["kernel"])
    constexprs = {
        k: getattr(tl, v[3:]) if isinstance(v, str) and v.startswith("tl.") else v
        for k, v in spec["constexprs"].items() if k in fn.arg_names
    }
    signature, aligned = {}, {}
    for index, name in enumerate(fn.arg_names):
        if name in constexprs:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = spec["pointers"][name.removesuffix("_ptr")]
            aligned[(index,)] = [["tt.divisibility", 16]]
        elif name == "scale_log2":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
            if name.startswith("stride_"):
                aligned[(index,)] = [["tt.divisibility", 16]]
    compiled = triton.compile(
        ASTSource(fn, signature, constexprs, aligned),
        target=GPUTarget("cuda", 90, 32),
        options={"num_warps": spec["num_warps"], "num_stages": spec["num_stages"]},
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [str(cuobjdump), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    results.append([int(usage.split("STACK:")[1].split()[0]), int(compiled.metadata.shared)])
print(json.dumps(results))
"""


def sm90_resources(specs: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """Compile kernels for an H200 (sm_90) with no GPU present and return each one's
    ``(stack bytes, shared memory bytes)``; stack bytes are register spills.

    A spec names ``module`` and ``kernel``, its ``constexprs`` (Triton dtypes as ``"tl.float32"``;
    names the kernel lacks are ignored), ``pointers`` (dtype of ``x`` for each ``x_ptr``),
    ``num_warps`` and ``num_stages``. Pointers and strides are taken as divisible by 16, the other
    integers as ``i32``, as a launch on aligned tensors specialises them.
    """
    if not (Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump").exists():
        pytest.skip("Triton's NVIDIA tools are not installed")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = Path(__file__).resolve().parents[3]
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_SM90, json.dumps(specs)],
        capture_output=True,
        text=True,
        env=env,
        cwd=root,
        check=False,
    )
    assert run.returncode == 0, run.stderr[-4000:]
    return [(stack, shared) for stack, shared in json.loads(run.stdout)]


def deepseek_constexprs(dtype: str) -> dict[str, Any]:
    """The shape constants a DeepSeek-V3 launch passes (L=512, R=64, page 64), unit strides included."""
    return {
        "PAGE_SIZE": DEEPSEEK_PAGE,
        "D_LATENT": DEEPSEEK_LATENT,
        "D_PE": DEEPSEEK_ROPE,
        "BLOCK_DMODEL": DEEPSEEK_LATENT,
        "BLOCK_DPE": DEEPSEEK_ROPE,
        "ACC_DTYPE": "tl.float64" if dtype == "fp64" else "tl.float32",
        "DOT_DTYPE": {"bf16": "tl.bfloat16", "fp32": "tl.float32", "fp64": "tl.float64"}[dtype],
        "DOT_PRECISION": "tf32" if dtype == "bf16" else "ieee",
    } | dict.fromkeys(["stride_q_d", "stride_qpe_d", "stride_kv_d", "stride_pt_p", "stride_out_d"], 1)


@pytest.mark.parametrize(
    "dtype",
    [
        "bf16",
        pytest.param("fp32", marks=pytest.mark.kernels_full),
        pytest.param("fp64", marks=pytest.mark.kernels_full),
    ],
)
def test_decode_compiles_for_h200_without_spills(dtype: str) -> None:
    """DeepSeek-V3 shapes, H=128, with the tiles a launch picks for the dtype."""
    narrow = dtype == "bf16"
    acc = "fp64" if dtype == "fp64" else "fp32"
    pointers = dict.fromkeys(["q", "q_pe", "kv", "out"], f"*{dtype}")
    pointers |= dict.fromkeys(["page_table", "seq_lens"], "*i64") | dict.fromkeys(
        ["part_out", "part_lse"], f"*{acc}"
    )
    module = "tandem.model.kernels.mla_decode_triton"
    split = {"BLOCK_H": BLOCK_H, "BLOCK_N": BLOCK_N if narrow else BLOCK_N_WIDE}
    specs = [
        {
            "module": module,
            "kernel": "_decode_split_kernel",
            "constexprs": deepseek_constexprs(dtype) | split,
            "pointers": pointers,
            "num_warps": NUM_WARPS if narrow else NUM_WARPS_WIDE,
            "num_stages": 2,
        },
        {
            "module": module,
            "kernel": "_decode_merge_kernel",
            "constexprs": deepseek_constexprs(dtype) | {"BLOCK_S": 16},
            "pointers": pointers,
            "num_warps": 4,
            "num_stages": 1,
        },
    ]
    if narrow:  # and the tiles the H100/H200 entries of the tuning table pick
        for kind in ("H100", "H200"):
            tiles = mla_decode_tiles(True, kind)
            tuned = {"BLOCK_H": tiles.block_h, "BLOCK_N": tiles.block_n}
            spec = specs[0] | {"constexprs": deepseek_constexprs(dtype) | tuned}
            specs.append(spec | {"num_warps": tiles.num_warps, "num_stages": tiles.num_stages})
    for stack, shared in sm90_resources(specs):
        assert stack == 0 and shared <= SM90_SHARED_BYTES
