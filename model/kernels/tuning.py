"""Tile sizes of the tuned kernels, one table per GPU kind, committed.

A kernel asks for its tiles by problem size; the table of the GPU this process runs on answers
(``TANDEM_GPU_KIND`` overrides the name; a GPU not in the table, and Triton's interpreter, use
``default``). ``scripts/gpu-check.sh`` times the entries on the GPU it runs on; a row is marked
``measured`` only once it has been timed there.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache

import torch


@dataclass(frozen=True)
class GemmTiles:
    block_m: int
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    measured: bool = False


# rows of the GEMM (tokens) -> tiles; the first bucket whose bound is >= rows answers
_Bucketed = tuple[tuple[int, GemmTiles], ...]
_FP8_GEMM: dict[str, _Bucketed] = {
    "default": (
        (16, GemmTiles(16, 64, 128, num_warps=4)),
        (64, GemmTiles(64, 64, 128, num_warps=4)),
        (1 << 62, GemmTiles(128, 128, 128, num_warps=8)),
    ),
    # decode-sized rows are bandwidth-bound: narrow M, wide N to stream the weight once
    "H200": (
        (16, GemmTiles(16, 128, 128, num_warps=4, num_stages=4)),
        (64, GemmTiles(64, 128, 128, num_warps=4, num_stages=4)),
        (1 << 62, GemmTiles(128, 128, 128, num_warps=8, num_stages=3)),
    ),
}


@lru_cache(maxsize=1)
def gpu_kind() -> str:
    """``TANDEM_GPU_KIND``, else the CUDA device's name reduced to a table key, else ``default``."""
    override = os.environ.get("TANDEM_GPU_KIND")
    if override:
        return override
    if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
        return "default"
    name = torch.cuda.get_device_name().upper()
    for kind in ("H200", "H100", "B200", "A100"):
        if kind in name:
            return kind
    return "default"


def fp8_gemm_tiles(rows: int, n: int, k: int, scale_bi: int, mode: str) -> GemmTiles:
    """Tiles for ``[rows, k] @ [n, k]^T`` with scale blocks ``bi`` columns wide: ``block_k``
    divides ``bi`` (one scale column per step) and no tile is wider than the problem needs."""
    table = _FP8_GEMM.get(gpu_kind(), _FP8_GEMM["default"])
    tiles = next(t for bound, t in table if rows <= bound)
    block_k = min(tiles.block_k, _pow2_at_least_16(k), scale_bi)
    block_k = math.gcd(block_k, scale_bi)
    if block_k < 16:
        raise ValueError(f"FP8 scale blocks {scale_bi} columns wide cannot be tiled by 16 or more")
    return GemmTiles(
        block_m=min(tiles.block_m, _pow2_at_least_16(rows)),
        block_n=min(tiles.block_n, _pow2_at_least_16(n)),
        block_k=block_k,
        num_warps=tiles.num_warps,
        num_stages=tiles.num_stages,
        measured=tiles.measured,
    )


def _pow2_at_least_16(value: int) -> int:
    return max(16, 1 << max(0, value - 1).bit_length())


@dataclass(frozen=True)
class DecodeTiles:
    """MLA decode (``mla_decode_triton``): ``block_h`` query heads share each KV tile of
    ``block_n`` tokens (the M and N of the score matmul)."""

    block_h: int
    block_n: int
    num_warps: int
    num_stages: int = 2
    measured: bool = False


# per GPU kind: 16-bit inputs ("narrow") and float32/float64 ("wide"); a kind without an entry for
# a width uses the default's. H100/H200: 64 heads a program (two head blocks for DeepSeek-V3's
# 128, each KV tile read twice instead of eight times) with 16-token tiles, the largest head block
# that compiles for sm_90 without spills (0 stack bytes, 128 KiB of shared memory at L=512;
# 64 heads x 32 tokens spills 48 bytes); its speed against the 16-head default is unmeasured.
DEFAULT_MLA_DECODE = {"narrow": DecodeTiles(16, 32, 4), "wide": DecodeTiles(16, 16, 8)}
_MLA_DECODE: dict[str, dict[str, DecodeTiles]] = {
    "default": DEFAULT_MLA_DECODE,
    "H200": {"narrow": DecodeTiles(64, 16, 8)},
    "H100": {"narrow": DecodeTiles(64, 16, 8)},
}


def mla_decode_tiles(narrow: bool, kind: str | None = None) -> DecodeTiles:
    """The tiles for 16-bit (``narrow``) or wider queries on GPU ``kind`` (this process's)."""
    width = "narrow" if narrow else "wide"
    table = _MLA_DECODE.get(kind or gpu_kind(), {})
    return table.get(width) or _MLA_DECODE["default"][width]


# the batch from which the Triton backend routes with the router GEMM fused in
# (``moe_gate_route_triton``): a program takes 16 tokens and streams the whole float32 router
# weight, so a decode batch would keep a few SMs busy where the two steps' GEMM uses them all.
# H100/H200: from 1,024 tokens (64 programs), unmeasured; elsewhere (the interpreter) always.
_FUSED_GATE_ROUTE_MIN_TOKENS = {"default": 0, "H100": 1024, "H200": 1024}


def fused_gate_route_min_tokens(kind: str | None = None) -> int:
    table = _FUSED_GATE_ROUTE_MIN_TOKENS
    return table.get(kind or gpu_kind(), table["default"])
