"""RMSNorm with a fused residual add, in Triton. One program normalises one row::

    x [N, D] (row stride given)  --(+ residual [N, D])-->  sum  --> residual out [N, D]
                                                            |
                                         weight * (sum * rsqrt(mean(sum^2) + eps))  --> out [N, D]

Rounding follows the torch reference: the sum is rounded to the activation dtype (it is the next
residual), statistics are float32, the normalised row is rounded before the weight multiply.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    x_stride,
    res_stride,
    dim,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < dim
    x = tl.load(x_ptr + row * x_stride + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(res_out_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * dim + offs, x, mask=mask)
    h = x.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / dim
    h = (h * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    tl.store(
        out_ptr + row * dim + offs,
        (w.to(tl.float32) * h.to(tl.float32)).to(out_ptr.dtype.element_ty),
        mask=mask,
    )


def rms_norm_triton(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    dim = x.shape[-1]
    x2 = x.reshape(-1, dim)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    rows = x2.shape[0]
    out = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
    if residual is None:
        res2, res_out = x2, x
    else:
        res2 = residual.reshape(-1, dim)
        if res2.stride(-1) != 1:
            res2 = res2.contiguous()
        res_out = torch.empty((rows, dim), dtype=x.dtype, device=x.device)
    if rows:
        _rms_norm_kernel[(rows,)](
            x2,
            res2,
            weight,
            out,
            res_out,
            x2.stride(0),
            res2.stride(0),
            dim,
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=triton.next_power_of_2(dim),
        )
    return out.view(x.shape), res_out.view(x.shape)
