"""The copies ``KVTiers`` decided, executed in order over a rank's KV pool (torch).

The host tier holds each kind of the pool's state as one tensor shaped like the pool's,
``[layers, host_pages, rows, dim]`` (pinned memory on a GPU, so copies to and from it are DMA).
``save`` and ``load`` are page copies between the two; ``fill`` copies a checked store payload
into a page; ``write`` reads a page's bytes and queues them for the store's writer thread, which
encodes (signs) them. A page's bytes are each kind's page layer-major (``tensor[:, page]`` made
contiguous), kind after kind in the pool's order, the same on every rank of one layout:
DeepSeek-V3's one kind, its latent; DeepSeek-V4's entries (compressed, indexer keys).

A kind the pool keeps in slots rather than by page (V4's window KV and overlap: a page's
boundary state, ``model/page_kinds.PageKind.in_slots``) goes with a page when the op names its
device slot (``TierOp.window_slot``): after the entries in a payload, and in the host slot of the
same number (the host keeps it for every host page).

Each kind's time is measured around its copies (on a GPU after a synchronize, so it is the
copies' time and not their queueing); the loads' bytes over that time are the tier's price.
"""

from __future__ import annotations

import time

import torch

from tandem.engine.kv_block_codec import BlockLayout
from tandem.engine.kv_tiers import KVTiers, TierConfig, TierOp
from tandem.model.kv_pool import KVPool


def _dtype(tensor: torch.Tensor) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def whole_kinds(pool: KVPool) -> list[str]:
    """The kinds kept for every page id: a page's entries."""
    return [kind.name for kind in pool.kinds if not kind.in_slots]


def boundary_kinds(pool: KVPool) -> list[str]:
    """The kinds kept in slots: a page's boundary state."""
    return [kind.name for kind in pool.kinds if kind.in_slots]


def pool_block_layout(pool: KVPool) -> BlockLayout:
    """A page's layout as the store names it: V3's one kind by its shape; several kinds (V4) by
    each entry kind's name, layers, rows, numbers a row and dtype (the boundary kinds' size is
    checked by length: ``TierConfig.boundary_bytes``)."""
    if len(pool.kinds) == 1:
        layers, _, page_size, dim = pool.kv.shape
        return BlockLayout(layers, page_size, dim, _dtype(pool.kv))
    parts = []
    for name in whole_kinds(pool):
        layers, _, rows, dim = pool.tensors[name].shape
        parts.append(f"{name}:{layers}x{rows}x{dim}-{_dtype(pool.tensors[name])}")
    num_layers = 1 + max(layer for kind in pool.kinds if not kind.in_slots for layer in kind.layers)
    first = pool.tensors[whole_kinds(pool)[0]]
    return BlockLayout(num_layers, pool.page_size, 0, _dtype(first), ";".join(parts))


def _kind_page_bytes(pool: KVPool, names: list[str]) -> int:
    total = 0
    for name in names:
        layers, _, rows, dim = pool.tensors[name].shape
        total += layers * rows * dim * pool.tensors[name].element_size()
    return total


def page_bytes(pool: KVPool) -> int:
    """One page's entries, every layer of every kind kept by page."""
    return _kind_page_bytes(pool, whole_kinds(pool))


def boundary_bytes(pool: KVPool) -> int:
    """One page's boundary state, every layer of every kind kept in slots (0: none)."""
    return _kind_page_bytes(pool, boundary_kinds(pool))


def boundary_share(pool: KVPool) -> float:
    """The share of pages whose boundary state the pool keeps (0: none)."""
    return min((kind.share for kind in pool.kinds if kind.in_slots), default=0.0)


class TierCopier:
    def __init__(self, pool: KVPool, tiers: KVTiers) -> None:
        self.pool = pool
        self.tiers = tiers
        self.whole, self.boundary = whole_kinds(pool), boundary_kinds(pool)
        host_pages = tiers.config.host_pages
        self.host: dict[str, torch.Tensor] = {}
        if host_pages > 0:
            for name, kv in pool.tensors.items():
                layers, _, rows, dim = kv.shape
                self.host[name] = torch.zeros(
                    (layers, host_pages, rows, dim), dtype=kv.dtype, pin_memory=kv.is_cuda
                )

    def run(self, ops: list[TierOp]) -> None:
        """Execute ``ops`` in order; loads are timed and priced per tier."""
        if not ops:
            return
        tensors = self.pool.tensors
        cuda = next(iter(tensors.values())).is_cuda
        timed = {"host": [0, 0.0], "store": [0, 0.0]}
        for op in ops:
            if op.kind == "save":
                for name in self._kinds(op):
                    self.host[name][:, op.slot].copy_(tensors[name][:, self._at(name, op)])
            elif op.kind == "load":
                start = time.monotonic()
                moved = 0
                for name in self._kinds(op):
                    page = tensors[name][:, self._at(name, op)]
                    page.copy_(self.host[name][:, op.slot], non_blocking=cuda)
                    moved += page.numel() * page.element_size()
                if cuda:
                    torch.cuda.current_stream(tensors[self.whole[0]].device).synchronize()
                timed["host"][0] += moved
                timed["host"][1] += time.monotonic() - start
            elif op.kind == "fill":
                start = time.monotonic()
                self._fill(op)
                timed["store"][1] += time.monotonic() - start
            else:  # write: after the forward that computed the page
                self._write(op)
        for tier, (num_bytes, seconds) in timed.items():
            if seconds > 0:
                self.tiers.observe_load(tier, int(num_bytes), float(seconds))

    def page_payload(self, page_id: int, window_slot: int = -1) -> bytes:
        """A page's bytes: its entries, then its boundary state from ``window_slot`` (if one)."""
        names = self.whole + (self.boundary if window_slot >= 0 else [])
        at = {name: window_slot if name in self.boundary else page_id for name in names}
        parts = [self.pool.tensors[name][:, at[name]].contiguous().view(torch.uint8) for name in names]
        return torch.cat([part.reshape(-1) for part in parts]).cpu().numpy().tobytes()

    def _kinds(self, op: TierOp) -> list[str]:
        return self.whole + (self.boundary if op.window_slot >= 0 else [])

    def _at(self, name: str, op: TierOp) -> int:
        """Where ``op``'s page of kind ``name`` is in the pool: its slot for a boundary kind."""
        return op.window_slot if name in self.boundary else op.page_id

    def _fill(self, op: TierOp) -> None:
        values = torch.frombuffer(bytearray(op.payload), dtype=torch.uint8)
        at = 0
        for name in self._kinds(op):
            page = self.pool.tensors[name][:, self._at(name, op)]
            size = page.numel() * page.element_size()
            chunk = values[at : at + size].view(page.dtype).view(page.shape)
            page.copy_(chunk.to(page.device))
            at += size
        # a boundary state not taken in (no slot for it) is left out: the page holds its entries

    def _write(self, op: TierOp) -> None:
        if self.tiers.writer is not None:
            self.tiers.write(op, self.page_payload(op.page_id, op.window_slot))


def build_tiers(pool: KVPool, config: TierConfig) -> tuple[KVTiers, TierCopier]:
    tiers = KVTiers(config)
    return tiers, TierCopier(pool, tiers)
