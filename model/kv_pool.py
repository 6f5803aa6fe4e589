"""The paged latent KV pool of one rank.

One tensor holds every layer::

    kv[layer, page, slot, :]  =  [ c (kv_lora_rank) | k_pe (qk_rope_head_dim) ]

    layer stride = num_pages * page_size * dim numbers; page stride = page_size * dim numbers

so one page of one layer is a contiguous run of bytes, which is what KV transfer moves. Page ids
come from the rank's page allocator; the pool itself keeps no ownership state.
"""

from __future__ import annotations

import torch

from tandem.kvtransfer.types import PoolLayout
from tandem.model.config import ModelConfig


class KVPool:
    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_layers: int | None = None,
    ) -> None:
        """``num_layers``: the decoder layers by default; one more with the MTP layer's KV."""
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.kv = torch.zeros(
            (num_layers or cfg.num_hidden_layers, num_pages, page_size, cfg.kv_cache_dim),
            dtype=dtype,
            device=device,
        )

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Each ``(source, destination)`` page's KV, every layer, into the destination (on the
        device's stream, ordered before the next forward)."""
        if copies:
            src = torch.tensor([s for s, _ in copies], device=self.kv.device)
            dst = torch.tensor([d for _, d in copies], device=self.kv.device)
            self.kv[:, dst] = self.kv[:, src]

    def layer(self, index: int) -> torch.Tensor:
        return self.kv[index]

    @property
    def layout(self) -> PoolLayout:
        return pool_layout(self.kv)

    @staticmethod
    def pages_for_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_page = cfg.num_hidden_layers * page_size * cfg.kv_cache_dim * itemsize
        return max(1, budget_bytes // per_page)


def pool_layout(kv: torch.Tensor) -> PoolLayout:
    """The transfer layout of a pool tensor ``[layers, pages, page_size, dim]`` (each page contiguous)."""
    layers, pages, page_size, dim = kv.shape
    if kv.stride(3) != 1 or kv.stride(2) != dim:
        raise ValueError(f"KV pool pages must be contiguous, got strides {kv.stride()}")
    item = kv.element_size()
    return PoolLayout(
        base_address=kv.data_ptr(),
        num_layers=layers,
        num_pages=pages,
        page_size=page_size,
        token_dim=dim,
        dtype=str(kv.dtype).removeprefix("torch."),
        layer_stride_bytes=kv.stride(0) * item,
        page_stride_bytes=kv.stride(1) * item,
        page_bytes=page_size * dim * item,
        mem_type="VRAM" if kv.is_cuda else "DRAM",
        device_id=kv.device.index or 0,
    )
