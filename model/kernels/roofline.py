"""Peak figures of the GPUs Tandem's kernels are timed against (dense, no sparsity), one table.

A kernel's fraction of its roofline is ``max(bytes / hbm, flops / peak) / measured seconds``:
the time the slower of its two limits allows, over the time it took.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Peaks:
    hbm_bytes_per_s: float
    bf16_flops: float
    fp8_flops: float


PEAKS: dict[str, Peaks] = {
    "H200": Peaks(hbm_bytes_per_s=4.8e12, bf16_flops=989e12, fp8_flops=1979e12),
    "H100": Peaks(hbm_bytes_per_s=3.35e12, bf16_flops=989e12, fp8_flops=1979e12),
    "B200": Peaks(hbm_bytes_per_s=8.0e12, bf16_flops=2250e12, fp8_flops=4500e12),
    "A100": Peaks(hbm_bytes_per_s=2.0e12, bf16_flops=312e12, fp8_flops=0.0),
}


def roofline_fraction(peaks: Peaks, seconds: float, bytes_moved: float, flops: float, fp8: bool) -> float:
    """How close ``seconds`` came to the time the kernel's bytes or flops need at peak."""
    peak_flops = peaks.fp8_flops if fp8 else peaks.bf16_flops
    bound = max(bytes_moved / peaks.hbm_bytes_per_s, flops / peak_flops if peak_flops else 0.0)
    return bound / seconds if seconds > 0 else 0.0
