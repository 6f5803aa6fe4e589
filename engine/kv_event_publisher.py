"""A prefill rank's KV events, fanned out to the frontends whose routers index its prefix cache.

A subscriber starts from a snapshot (every block hash cached at that moment, ``seq`` 0, with
``reset`` set: forget what you knew of this rank) and then receives each later batch of events
with ``seq`` 1, 2, ... Snapshot and batches are made on the rank's loop thread, so no event falls
between them; a subscriber applies batches in ``seq`` order and subscribes again after a gap.
"""

from __future__ import annotations

from tandem.wire.kv_events import AllBlocksCleared, BlockStored, KVEvent, KVEventBatch, Tier
from tandem.wire.messages import RankId


class KVEventPublisher:
    def __init__(self, rank: RankId, page_size: int, incarnation: int = 0) -> None:
        self.rank = rank
        self.incarnation = incarnation
        self.page_size = page_size
        self._next_seq: dict[str, int] = {}  # subscriber -> seq of its next batch

    @property
    def subscribers(self) -> list[str]:
        return sorted(self._next_seq)

    def subscribe(
        self,
        subscriber: str,
        cached_block_hashes: list[int],
        host_block_hashes: list[int] | None = None,
        store_block_hashes: list[int] | None = None,
    ) -> KVEventBatch:
        """(Re)start ``subscriber`` from a snapshot of the cache: its device blocks, and the
        blocks of its host tier and those it knows are in the store."""
        self._next_seq[subscriber] = 1
        events: list[KVEvent] = [AllBlocksCleared()]
        tiers: tuple[tuple[Tier, list[int] | None], ...] = (
            ("device", cached_block_hashes),
            ("host", host_block_hashes),
            ("store", store_block_hashes),
        )
        for tier, blocks in tiers:
            if blocks:
                # the index needs only the hashes; chaining is already in each hash
                events.append(BlockStored(tuple(blocks), None, self.page_size, tier))
        return KVEventBatch(self.rank, self.incarnation, 0, True, events)

    def unsubscribe(self, subscriber: str) -> None:
        self._next_seq.pop(subscriber, None)

    def publish(self, events: list[KVEvent]) -> dict[str, KVEventBatch]:
        """The batch each subscriber gets for ``events`` (nothing when there are none)."""
        if not events:
            return {}
        out: dict[str, KVEventBatch] = {}
        for subscriber, seq in self._next_seq.items():
            out[subscriber] = KVEventBatch(self.rank, self.incarnation, seq, False, list(events))
            self._next_seq[subscriber] = seq + 1
        return out
