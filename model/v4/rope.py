"""DeepSeek-V4's rotary embedding: interleaved pairs ``(x0, x1), (x2, x3), ...`` on the trailing
``qk_rope_head_dim`` dims of a head, the leading dims untouched, computed in float32. Two tables:
``main`` (sliding-window layers) and ``compress`` (layers with a compressor, their compressor
and indexer), each ``cos, sin [max_positions, rope_dim / 2]`` with its attention factor in.

The attention output's rope dims are rotated back by the query's position (``sin`` negated), so
a value's contribution depends only on its distance to the query (K = V)."""

from __future__ import annotations

import torch

from tandem.model.config import RopeConfig
from tandem.model.kernels.rope import rope_cos_sin_table


def rope_table(rope: RopeConfig, rope_dim: int, max_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
    return rope_cos_sin_table(rope, rope_dim, max_positions)


def rotate_tail(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """``x [T, ..., D]`` with its last ``2 * cos.shape[-1]`` dims rotated by ``cos, sin [T, R/2]``
    (float32 math, ``x``'s dtype out)."""
    rope_dim = 2 * cos.shape[-1]
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (rope_dim,)
    c = cos.repeat_interleave(2, dim=-1).view(shape)
    s = sin.repeat_interleave(2, dim=-1).view(shape)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    half = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * c + half.float() * s).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)
