"""Scatter of new tokens' latent KV into one layer's paged pool, in Triton.

One program writes one token::

    latent [T, L]   k_pe [T, R]            kv_layer [num_pages, page_size, L + R]
    token t ─────────────────────────────▶ page  slot_mapping[t] // page_size,
                                           slot  slot_mapping[t] %  page_size
                                           row   [ latent[t] | k_pe[t] ]   (cast to the pool dtype)

Only the rows named by ``slot_mapping`` are written. A negative slot is padding and writes
nothing (a GPU would otherwise write before the pool); valid slots are ``0 .. num_pages *
page_size - 1``, as the page allocator hands them out.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl


@triton.jit
def _kv_store_kernel(
    kv_ptr,
    slot_ptr,
    latent_ptr,
    pe_ptr,
    stride_kv_page,
    stride_kv_slot,
    stride_kv_d,
    stride_latent_t,
    stride_latent_d,
    stride_pe_t,
    stride_pe_d,
    page_size,
    D_LATENT: tl.constexpr,
    D_PE: tl.constexpr,
    BLOCK_LATENT: tl.constexpr,
    BLOCK_PE: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot >= 0:
        row = kv_ptr + (slot // page_size) * stride_kv_page + (slot % page_size) * stride_kv_slot
        offs_l = tl.arange(0, BLOCK_LATENT)
        mask_l = offs_l < D_LATENT
        latent = tl.load(latent_ptr + token * stride_latent_t + offs_l * stride_latent_d, mask=mask_l)
        tl.store(row + offs_l * stride_kv_d, latent.to(kv_ptr.dtype.element_ty), mask=mask_l)
        offs_r = tl.arange(0, BLOCK_PE)
        mask_r = offs_r < D_PE
        pe = tl.load(pe_ptr + token * stride_pe_t + offs_r * stride_pe_d, mask=mask_r)
        tl.store(row + (D_LATENT + offs_r) * stride_kv_d, pe.to(kv_ptr.dtype.element_ty), mask=mask_r)


def kv_store_triton(
    kv_layer: torch.Tensor, slot_mapping: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor
) -> None:
    """Write ``[latent | k_pe]`` of token ``t`` into pool slot ``slot_mapping[t]`` (in place)."""
    num_tokens, latent_dim = latent.shape
    pe_dim = k_pe.shape[-1]
    if kv_layer.shape[-1] != latent_dim + pe_dim:
        raise ValueError(
            f"kv_layer rows hold {kv_layer.shape[-1]} numbers; latent {latent_dim} + k_pe {pe_dim} do not fit"
        )
    if num_tokens == 0:
        return
    # Triton launches on the current CUDA device, not necessarily the pool's
    guard = torch.cuda.device(kv_layer.device) if kv_layer.is_cuda else contextlib.nullcontext()
    with guard:
        _kv_store_kernel[(num_tokens,)](
            kv_layer,
            slot_mapping,
            latent,
            k_pe,
            kv_layer.stride(0),
            kv_layer.stride(1),
            kv_layer.stride(2),
            latent.stride(0),
            latent.stride(1),
            k_pe.stride(0),
            k_pe.stride(1),
            kv_layer.shape[1],
            D_LATENT=latent_dim,
            D_PE=pe_dim,
            BLOCK_LATENT=triton.next_power_of_2(latent_dim),
            BLOCK_PE=triton.next_power_of_2(pe_dim),
            num_warps=4 if latent_dim >= 256 else 1,
        )
