"""The copies ``KVTiers`` decided, executed in order over a rank's KV pool (torch).

The host tier is one tensor shaped like the pool, ``[layers, host_pages, page_size, dim]``
(pinned memory on a GPU, so copies to and from it are DMA). ``save`` and ``load`` are page
copies between the two; ``fill`` copies a checked store payload into a page; ``write`` reads a
page's bytes and queues them for the store's writer thread, which encodes (signs) them. A page's
bytes are its KV layer-major (``kv[:, page]`` made contiguous), the same on every rank of one
layout.

Each kind's time is measured around its copies (on a GPU after a synchronize, so it is the
copies' time and not their queueing); the loads' bytes over that time are the tier's price.
"""

from __future__ import annotations

import time

import torch

from tandem.engine.kv_block_codec import BlockLayout
from tandem.engine.kv_tiers import KVTiers, TierConfig, TierOp
from tandem.model.kv_pool import KVPool


def pool_block_layout(pool: KVPool) -> BlockLayout:
    layers, _, page_size, dim = pool.kv.shape
    return BlockLayout(layers, page_size, dim, str(pool.kv.dtype).removeprefix("torch."))


def page_bytes(pool: KVPool) -> int:
    layers, _, page_size, dim = pool.kv.shape
    return layers * page_size * dim * pool.kv.element_size()


class TierCopier:
    def __init__(self, pool: KVPool, tiers: KVTiers) -> None:
        self.pool = pool
        self.tiers = tiers
        kv = pool.kv
        host_pages = tiers.config.host_pages
        self.host: torch.Tensor | None = None
        if host_pages > 0:
            layers, _, page_size, dim = kv.shape
            self.host = torch.zeros(
                (layers, host_pages, page_size, dim), dtype=kv.dtype, pin_memory=kv.is_cuda
            )

    def run(self, ops: list[TierOp]) -> None:
        """Execute ``ops`` in order; loads are timed and priced per tier."""
        if not ops:
            return
        kv, cuda = self.pool.kv, self.pool.kv.is_cuda
        page = self.tiers.config.page_bytes
        timed = {"host": [0, 0.0], "store": [0, 0.0]}
        for op in ops:
            if op.kind == "save":
                assert self.host is not None
                self.host[:, op.slot].copy_(kv[:, op.page_id])
            elif op.kind == "load":
                assert self.host is not None
                start = time.monotonic()
                kv[:, op.page_id].copy_(self.host[:, op.slot], non_blocking=cuda)
                if cuda:
                    torch.cuda.current_stream(kv.device).synchronize()
                timed["host"][0] += page
                timed["host"][1] += time.monotonic() - start
            elif op.kind == "fill":
                start = time.monotonic()
                values = torch.frombuffer(bytearray(op.payload), dtype=torch.uint8)
                kv[:, op.page_id].copy_(values.view(kv.dtype).view(kv[:, op.page_id].shape))
                timed["store"][1] += time.monotonic() - start
            else:  # write: after the forward that computed the page
                self._write(op)
        for tier, (num_bytes, seconds) in timed.items():
            if seconds > 0:
                self.tiers.observe_load(tier, int(num_bytes), float(seconds))

    def page_payload(self, page_id: int) -> bytes:
        data = self.pool.kv[:, page_id].contiguous().view(torch.uint8)
        return data.cpu().numpy().tobytes()

    def _write(self, op: TierOp) -> None:
        if self.tiers.writer is not None:
            self.tiers.write(op, self.page_payload(op.page_id))


def build_tiers(pool: KVPool, config: TierConfig) -> tuple[KVTiers, TierCopier]:
    tiers = KVTiers(config)
    return tiers, TierCopier(pool, tiers)
