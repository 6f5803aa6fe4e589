"""The paged KV pool of one rank: one preallocated tensor per kind of state
(``model/page_kinds.py``), a page for every page id (a kind kept in slots: a slot for every slot
id)::

    tensors[kind][layer, page, row, :]   (``layer`` counts the kind's layers)

    layer stride = num_pages * rows * dim numbers; page stride = rows * dim numbers

so one page of one layer of one kind is a contiguous run of bytes, which is what KV transfer
moves. DeepSeek-V3 keeps one kind, its latent::

    kv[layer, page, slot, :]  =  [ c (kv_lora_rank) | k_pe (qk_rope_head_dim) ]

DeepSeek-V4 several (``model/v4/kv_layout.v4_page_kinds``: window KV, compressed entries by
rate, indexer keys, the compressors' overlap). Page ids come from the rank's page allocator; the
pool itself keeps no ownership state.
"""

from __future__ import annotations

import dataclasses

import torch

from tandem.kvtransfer.regions import Region, one_region
from tandem.kvtransfer.types import PoolLayout
from tandem.model.config import ModelConfig
from tandem.model.page_kinds import PageKind, latent_kinds, pool_page_bytes


class KVPool:
    def __init__(
        self,
        cfg: ModelConfig | None,
        num_pages: int,
        page_size: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        num_layers: int | None = None,
        kinds: list[PageKind] | None = None,
    ) -> None:
        """``kinds``: what each page keeps; by default ``cfg``'s (a DeepSeek-V3) latent in its
        decoder layers, or in ``num_layers`` (one more with the MTP layer's KV). DeepSeek-V4
        passes its kinds (``model/v4/kv_layout.v4_page_kinds``)."""
        if num_pages <= 0 or page_size <= 0:
            raise ValueError(f"num_pages and page_size must be positive, got {num_pages}, {page_size}")
        if kinds is None:
            if cfg is None:
                raise ValueError("a KV pool needs the model's config or its kinds of state")
            kinds = latent_kinds(num_layers or cfg.num_hidden_layers, page_size, cfg.kv_cache_dim)
        self.page_size = page_size
        self.num_pages = num_pages
        self.kinds = kinds
        self.tensors = {
            kind.name: torch.zeros(
                (len(kind.layers), kind.slots(num_pages), kind.rows, kind.dim),
                dtype=torch.float32 if kind.float32 else dtype,
                device=device,
            )
            for kind in self.kinds
        }
        self._index = {kind.name: {layer: i for i, layer in enumerate(kind.layers)} for kind in self.kinds}

    @property
    def kv(self) -> torch.Tensor:
        """The one kind's tensor ``[layers, pages, rows, dim]`` of a one-kind (V3) pool."""
        if len(self.tensors) != 1:
            raise ValueError(f"this pool keeps {len(self.tensors)} kinds of state: name one ({self.names})")
        return next(iter(self.tensors.values()))

    @property
    def names(self) -> list[str]:
        return [kind.name for kind in self.kinds]

    def kind(self, name: str, layer: int) -> torch.Tensor:
        """Model layer ``layer``'s pages of kind ``name``: ``[pages, rows, dim]``."""
        return self.tensors[name][self._index[name][layer]]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Each ``(source, destination)`` page's state, every kind kept whole and layer, into the
        destination (on the device's stream, ordered before the next forward)."""
        slotted = [kind.name for kind in self.kinds if kind.in_slots]
        if copies and slotted:
            raise ValueError(f"kinds {slotted} are kept in slots, not by page id: no page copy")
        if copies:
            for kv in self.tensors.values():
                src = torch.tensor([s for s, _ in copies], device=kv.device)
                dst = torch.tensor([d for _, d in copies], device=kv.device)
                kv[:, dst] = kv[:, src]

    def layer(self, index: int) -> torch.Tensor:
        return self.kv[index]

    @property
    def layout(self) -> PoolLayout:
        """The one kind's transfer layout (V3)."""
        return pool_layout(self.kv)

    def layouts(self) -> dict[str, PoolLayout]:
        """Every kind's transfer layout, by name."""
        return {name: pool_layout(kv) for name, kv in self.tensors.items()}

    def regions(self, names: list[str] | None = None) -> list[Region]:
        """Transfer regions (``kvtransfer/regions.py``) of the kinds ``names`` (every kind by
        default), each over its model layers; page ``p`` of a kind's ``i``-th layer is one entry."""
        regions = []
        for kind in self.kinds:
            if names is not None and kind.name not in names:
                continue
            layout = pool_layout(self.tensors[kind.name])
            region = one_region(
                kind.name,
                layout.base_address,
                layout.num_layers,
                layout.num_pages,
                layout.layer_stride_bytes,
                layout.page_stride_bytes,
                layout.page_bytes,
                layout.dtype,
            )
            regions.append(dataclasses.replace(region, layers=kind.layers))
        return regions

    @staticmethod
    def pages_for_bytes(cfg: ModelConfig, page_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        per_page = pool_page_bytes(latent_kinds(cfg.num_hidden_layers, page_size, cfg.kv_cache_dim), itemsize)
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
