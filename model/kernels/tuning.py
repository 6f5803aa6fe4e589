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
