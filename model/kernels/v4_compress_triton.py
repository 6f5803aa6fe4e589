"""A DeepSeek-V4 compressor's complete windows to entries in Triton: the gated pool over each
window's slots and the RMSNorm, fused (``compress_windows_torch`` in ``v4_attention.py`` is the
reference).

Grid ``(W,)``: a program makes entry ``w`` from the projections where they lie (no slot buffer):
with overlap, window ``w``'s second halves (``Cb``) and then window ``w - 1``'s first halves
(``Ca``; for ``w = 0`` the previous call's overlap, or none), each slot's gate plus its ``ape``
row, an online softmax per feature over the slots, float32 throughout; then the entry's RMSNorm
times ``norm``. (The slots are visited ``Cb`` first so that the running maximum is finite before
a missing ``Ca`` slot, whose gate is ``-inf``, comes.)"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.model.kernels.mla_decode_triton import on_device


@triton.jit
def _slot(m_i, l_i, acc, kv, gate):
    m_new = tl.maximum(m_i, gate)
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(gate - m_new)
    return m_new, l_i * alpha + p, acc * alpha + p * kv


@triton.jit
def _compress_kernel(
    kv_ptr,
    gate_ptr,
    ape_ptr,
    prev_kv_ptr,
    prev_gate_ptr,
    norm_ptr,
    out_ptr,
    rate,
    dim,
    width,
    eps,
    OVERLAP: tl.constexpr,
    HAS_PREV: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    w = tl.program_id(0).to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    d_mask = dims < dim
    second = dim if OVERLAP else 0  # where a window's own part (Cb) starts in a row
    m_i = tl.full([BLOCK_D], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_D], dtype=tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for j in range(0, rate):
        at = (w * rate + j) * width + second + dims
        kv = tl.load(kv_ptr + at, mask=d_mask, other=0.0)
        gate = tl.load(gate_ptr + at, mask=d_mask, other=0.0) + tl.load(
            ape_ptr + j * width + second + dims, mask=d_mask, other=0.0
        )
        m_i, l_i, acc = _slot(m_i, l_i, acc, kv, gate)
    if OVERLAP:
        later = (dims * 0 + w) > 0  # a window before this one: its Ca, else the previous call's
        for j in range(0, rate):
            at = ((w - 1) * rate + j) * width + dims
            has = d_mask & later
            kv = tl.load(kv_ptr + at, mask=has, other=0.0)
            gate = tl.load(gate_ptr + at, mask=has, other=0.0) + tl.load(
                ape_ptr + j * width + dims, mask=d_mask, other=0.0
            )
            gate = tl.where(later, gate, float("-inf"))
            if HAS_PREV:
                first = d_mask & ~later
                kv = tl.where(later, kv, tl.load(prev_kv_ptr + j * dim + dims, mask=first, other=0.0))
                gate = tl.where(later, gate, tl.load(prev_gate_ptr + j * dim + dims, mask=first, other=0.0))
            m_i, l_i, acc = _slot(m_i, l_i, acc, kv, gate)
    pooled = tl.where(d_mask, acc / l_i, 0.0)
    rms = tl.rsqrt(tl.sum(pooled * pooled, axis=0) / dim + eps)
    norm = tl.load(norm_ptr + dims, mask=d_mask, other=0.0)
    tl.store(out_ptr + w * dim + dims, pooled * rms * norm, mask=d_mask)


def compress_windows_triton(
    kv: torch.Tensor,
    gate: torch.Tensor,
    ape: torch.Tensor,
    norm: torch.Tensor,
    eps: float,
    overlap: bool,
    prev_kv: torch.Tensor | None,
    prev_gate: torch.Tensor | None,
) -> torch.Tensor:
    """As ``compress_windows_torch``: ``kv, gate [W, r, width]`` float32 -> ``[W, dim]`` float32."""
    windows, rate, width = kv.shape
    dim = width // 2 if overlap else width
    out = torch.empty(windows, dim, dtype=torch.float32, device=kv.device)
    if windows == 0:
        return out
    has_prev = overlap and prev_kv is not None and prev_gate is not None
    kv, gate, ape = kv.float().contiguous(), gate.float().contiguous(), ape.float().contiguous()
    prev_kv = prev_kv.float().contiguous() if has_prev and prev_kv is not None else kv
    prev_gate = prev_gate.float().contiguous() if has_prev and prev_gate is not None else gate
    with on_device(kv.device):
        _compress_kernel[(windows,)](
            kv, gate, ape, prev_kv, prev_gate, norm.float().contiguous(), out, rate, dim, width, eps,
            OVERLAP=overlap, HAS_PREV=has_prev, BLOCK_D=triton.next_power_of_2(dim),
        )  # fmt: skip
    return out
