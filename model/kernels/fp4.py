"""FP4 routed experts as DeepSeek-V4 ships them (OCP MXFP4), kept FP4: the format and its torch
references.

A weight ``[out, in]`` is two tensors. Bytes ``[out, in / 2]`` hold two e2m1 numbers each, the
**low nibble first** (input ``2j`` in the low four bits of byte ``j``, ``2j + 1`` in the high
four). Scale bytes ``[out, in / 32]`` hold one E8M0 power of two per 32 consecutive inputs of a
row (no other scale)::

    weight[o, i] = E2M1[nibble(o, i)] * 2 ** (scale[o, i // 32] - 127)

    nibble  0    1    2    3    4    5    6    7   |  8 .. 15
    e2m1    0   0.5   1   1.5   2    3    4    6   |  the same, negative (sign bit 3)

A checkpoint stores the bytes as ``I8`` and the scales as ``F8_E8M0``; a rank keeps both as raw
bytes (``uint8``): half a byte a weight and a thirty-second of a byte for its scale. Every
product of an e2m1 number and a power of two is exact in bfloat16 and float32, so dequantising
into the activations' dtype and multiplying there gives the dequantised model's result up to
summation order (the Triton kernels dequantise per tile, in registers:
``moe_experts_fp4_triton``)."""

from __future__ import annotations

import torch

FP4_GROUP = 32  # weights per scale, along a row (the input)
E8M0_BIAS = 127
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0


def e2m1_table(device: torch.device | str = "cpu") -> torch.Tensor:
    """The 16 nibbles' values, float32 (8 is negative zero)."""
    positive = torch.tensor(E2M1, dtype=torch.float32, device=device)
    return torch.cat([positive, -positive])


def fp4_shapes(out_dim: int, in_dim: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The bytes' and the scales' shapes of an ``[out_dim, in_dim]`` FP4 weight."""
    if in_dim % FP4_GROUP:
        raise ValueError(f"an FP4 weight's input width {in_dim} is not a multiple of {FP4_GROUP}")
    return (out_dim, in_dim // 2), (out_dim, in_dim // FP4_GROUP)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``[out, in]`` float32 from the bytes ``[out, in / 2]`` and the scale bytes ``[out, in / 32]``
    (``uint8``, or the checkpoint's ``int8`` and ``float8_e8m0fnu`` seen as bytes)."""
    packed, scale = as_bytes(packed), as_bytes(scale)
    out_dim, half = packed.shape
    nibbles = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(out_dim, 2 * half)
    values = e2m1_table(packed.device)[nibbles.long()]
    factor = torch.exp2(scale.float() - E8M0_BIAS).repeat_interleave(FP4_GROUP, dim=1)
    return values * factor


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight [out, in]`` as FP4 bytes and scale bytes (``uint8``): each group of 32 scaled by
    the least power of two that brings its largest magnitude within e2m1's 6, each number then
    rounded to the nearest e2m1 value."""
    (out_dim, half), (_, groups) = fp4_shapes(*weight.shape)
    grouped = weight.float().reshape(out_dim, groups, FP4_GROUP)
    amax = grouped.abs().amax(dim=-1)
    exponent = torch.ceil(torch.log2(amax.clamp(min=2.0**-126) / E2M1_MAX)).clamp(-E8M0_BIAS, E8M0_BIAS)
    scaled = grouped / torch.exp2(exponent)[..., None]
    table = e2m1_table(weight.device)
    nibbles = (scaled[..., None] - table).abs().argmin(dim=-1).reshape(out_dim, 2 * half).to(torch.uint8)
    packed = nibbles[:, 0::2] | (nibbles[:, 1::2] << 4)
    return packed, (exponent + E8M0_BIAS).to(torch.uint8)


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A one-byte tensor's raw bytes as ``uint8`` (a checkpoint's ``int8`` FP4 pairs and
    ``float8_e8m0fnu`` scales are these bytes, not numbers to convert)."""
    if tensor.dtype == torch.uint8:
        return tensor
    if tensor.element_size() != 1:
        raise ValueError(f"FP4 bytes and scales are one byte each, got {tensor.dtype}")
    return tensor.view(torch.uint8)
