"""The paged latent KV pool of one rank.

One tensor holds every layer::

    kv[layer, page, slot, :]  =  [ c (kv_lora_rank) | k_pe (qk_rope_head_dim) ]

    layer stride = num_pages * page_size * dim numbers; page stride = page_size * dim numbers

so one page of one layer is a contiguous run of bytes, which is what KV transfer moves. Page ids
come from the rank's page allocator; the pool itself keeps no ownership state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from model.config import ModelConfig


@dataclass(frozen=True)
class KVPoolLayout:
    num_layers: int
    num_pages: int
    page_size: int
    token_dim: int
    dtype: str
    itemsize: int

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.token_dim * self.itemsize

    @property
    def layer_bytes(self) -> int:
        return self.num_pages * self.page_bytes


class KVPool:
    def __init__(
        self,
        cfg: ModelConfig,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        self.page_size = page_size
        self.num_pages = num_pages
        self.kv = torch.zeros(
            (cfg.num_hidden_layers, num_pages, page_size, cfg.kv_cache_dim), dtype=dtype, device=device
        )

    def layer(self, index: int) -> torch.Tensor:
        return self.kv[index]

    @property
    def layout(self) -> KVPoolLayout:
        layers, pages, page_size, dim = self.kv.shape
        return KVPoolLayout(layers, pages, page_size, dim, str(self.kv.dtype), self.kv.element_size())

    @staticmethod
    def pages_for_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_page = cfg.num_hidden_layers * page_size * cfg.kv_cache_dim * itemsize
        return max(1, budget_bytes // per_page)
