"""Rotary position embedding with YaRN scaling, as DeepSeek-V3 uses it (torch reference).

The cos/sin table is computed in float32, exactly as the reference model does, and cast to the
activation dtype when used. With ``rope_interleave`` the rotary dims are pairs ``(x0, x1), (x2,
x3), ...``; the output is laid out as ``[rotated evens | rotated odds]`` for queries and keys
alike, so their dot products are unchanged and the pool stores keys in that layout.
"""

from __future__ import annotations

import math

import torch

from tandem.model.config import RopeConfig, yarn_mscale


def rope_inv_freq(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies ``[dim/2]`` (float32) and the attention factor applied to cos/sin."""
    if rope.rope_type == "default":
        return 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
    factor = rope.factor
    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        orig = rope.original_max_position_embeddings
        return (dim * math.log(orig / (rotations * 2 * math.pi))) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2).to(dtype=torch.float) / dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_factor) + inv_extra * extrapolation_factor
    return inv_freq, float(attention_factor)


def rope_cos_sin_table(rope: RopeConfig, dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``cos, sin [max_positions, dim/2]`` in float32, attention factor included."""
    inv_freq, attention_factor = rope_inv_freq(rope, dim)
    freqs = torch.arange(max_positions, dtype=torch.int64).float()[:, None] * inv_freq[None, :]
    return freqs.cos() * attention_factor, freqs.sin() * attention_factor


def apply_rope_torch(
    q_pe: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    cos_q, sin_q = cos[:, None, :], sin[:, None, :]

    def rotate(x: torch.Tensor, c: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        if interleave:
            x1, x2 = x[..., 0::2], x[..., 1::2]
        else:
            half = x.shape[-1] // 2
            x1, x2 = x[..., :half], x[..., half:]
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)

    return rotate(q_pe, cos_q, sin_q), rotate(k_pe, cos, sin)
