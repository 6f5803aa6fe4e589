"""The KV events of the prefill ranks a frontend follows, applied to its router in order.

Per rank: subscribe on the frontend's channel to it (the rank sends a snapshot, ``seq`` 0, before
its answer, and batches 1, 2, ... from then on), apply batches in ``seq`` order holding any that
come early, drop batches of another incarnation (a rebuilt rank keeps its name and starts a new
sequence), and forget the rank when a batch is lost or the subscription fails, so that the next
refresh subscribes again.
"""

from __future__ import annotations

import logging
from typing import Any

from tandem.router.router import Router
from tandem.wire.kv_events import KVEventBatch
from tandem.wire.messages import RankId

log = logging.getLogger(__name__)

MAX_EARLY_BATCHES = 1000  # held for a missing batch before giving up on it


class KVEventFeed:
    def __init__(self, router: Router[RankId]) -> None:
        self.router = router
        self.following: dict[RankId, int] = {}  # rank -> incarnation whose events are applied
        self._next_seq: dict[RankId, int] = {}
        self._early: dict[RankId, dict[int, KVEventBatch]] = {}
        self._subscribing: set[RankId] = set()

    def needs_subscription(self, rank: RankId, incarnation: int) -> bool:
        return self.following.get(rank) != incarnation and rank not in self._subscribing

    async def subscribe(self, rank: RankId, incarnation: int, channel: Any) -> None:
        """Follow ``rank`` from a fresh snapshot, asked for on ``channel`` (a ``RankChannel`` to
        that incarnation): the snapshot and the batches come to :meth:`on_batch`."""
        self._subscribing.add(rank)
        self.following[rank] = incarnation
        self._next_seq[rank] = 0
        self._early[rank] = {}
        try:
            await channel.subscribe()
        except Exception as exc:
            log.warning("prefill rank %s: KV event subscription failed: %s", rank, exc)
            if self.following.get(rank) == incarnation:
                self.forget(rank)
        finally:
            self._subscribing.discard(rank)

    def on_batch(self, batch: KVEventBatch) -> None:
        rank = batch.rank
        if self.following.get(rank) != batch.incarnation:
            return
        expected = self._next_seq.get(rank, 0)
        if batch.seq < expected:
            return
        early = self._early.setdefault(rank, {})
        early[batch.seq] = batch
        while expected in early:
            self.router.apply_events(rank, early.pop(expected).events)
            expected += 1
        self._next_seq[rank] = expected
        if len(early) > MAX_EARLY_BATCHES:
            log.warning("prefill rank %s: KV event batch %d never came; resubscribing", rank, expected)
            self.forget(rank)

    def forget(self, rank: RankId) -> None:
        self.following.pop(rank, None)
        self._next_seq.pop(rank, None)
        self._early.pop(rank, None)

    def keep_only(self, ranks: set[RankId]) -> None:
        for rank in list(self.following):
            if rank not in ranks:
                self.forget(rank)
