"""Which prefill rank caches which block, and in which tier, rebuilt from the ranks' KV events.

Each prefill rank has its own prefix cache in two tiers, its device pages and its host-memory
pool, and all ranks share one store. Every change is a ``KVEvent`` naming its tier. The index
keeps both directions of the rank tiers' relation, one pair of maps per tier, and the store as
one set that belongs to no rank::

    device  ranks_by_hash   h0 -> {p0-r0, p0-r1}   h1 -> {p0-r0}
            hashes_by_rank  p0-r0 -> {h0, h1}      p0-r1 -> {h0}
    host    ranks_by_hash   h2 -> {p0-r0}          hashes_by_rank  p0-r0 -> {h2}
    store   {h0, h1, h2, h3}                       (any rank's events add and remove)

A block evicted from a rank's device to its host is a device removal and a host store: the
rank still holds it. ``AllBlocksCleared`` and ``remove_rank`` forget a rank's device and host
tiers; the store outlives any rank, and a store removal from any rank removes the block.

Invariant (``check_integrity``): in each rank tier the two maps describe the same set of
(rank, hash) pairs and no hash maps to an empty set. Block hashes are chained (a hash names its
whole prefix), so a rank's usable run for a prompt is the run of the prompt's leading hashes
each found in its device or host tier or in the store, up to the first found in none; each
block of the run counts in the nearest tier holding it (device, then host, then store), which
is where the rank loads it from.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic

from tandem.router.rank_key import K
from tandem.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent, Tier

RANK_TIERS: tuple[Tier, ...] = ("device", "host")  # a rank's own; the store is everyone's


class IndexIntegrityError(AssertionError):
    """The two maps of a tier disagree: a bug in the index, not bad input."""


@dataclass(frozen=True)
class TierMatch:
    """One rank's usable run for a prompt, split by the tier each block is loaded from."""

    device: int = 0
    host: int = 0
    store: int = 0

    @property
    def blocks(self) -> int:
        """The whole usable run."""
        return self.device + self.host + self.store


@dataclass(frozen=True)
class TieredMatch(Generic[K]):
    """``by_rank``: the run of each rank holding one of the run's blocks itself. Any other rank
    gets ``store_blocks``, the prompt's leading blocks in the store (see ``get``)."""

    by_rank: dict[K, TierMatch] = field(default_factory=dict)
    store_blocks: int = 0

    def get(self, rank: K) -> TierMatch:
        found = self.by_rank.get(rank)
        return found if found is not None else TierMatch(store=self.store_blocks)


class _RankTier(Generic[K]):
    """One tier of every rank: hash -> ranks holding it, and rank -> hashes it holds."""

    def __init__(self, tier: Tier) -> None:
        self.tier = tier
        self.ranks_by_hash: dict[int, set[K]] = {}
        self.hashes_by_rank: dict[K, set[int]] = {}

    def add(self, rank: K, blocks: Iterable[int]) -> None:
        held = self.hashes_by_rank.setdefault(rank, set())
        for block in blocks:
            if block not in held:
                held.add(block)
                self.ranks_by_hash.setdefault(block, set()).add(rank)

    def discard(self, rank: K, blocks: Iterable[int]) -> None:
        held = self.hashes_by_rank.get(rank)
        if held is None:
            return
        for block in blocks:
            if block in held:
                held.discard(block)
                self._drop_holder(block, rank)

    def remove_rank(self, rank: K) -> None:
        for block in self.hashes_by_rank.pop(rank, set()):
            self._drop_holder(block, rank)

    def check_integrity(self) -> None:
        pairs = 0
        for block, holders in self.ranks_by_hash.items():
            if not holders:
                raise IndexIntegrityError(f"{self.tier}: hash {block:#x} maps to no rank")
            for rank in holders:
                if block not in self.hashes_by_rank.get(rank, ()):
                    raise IndexIntegrityError(
                        f"{self.tier}: hash {block:#x} lists {rank}, which does not hold it"
                    )
            pairs += len(holders)
        if pairs != sum(len(held) for held in self.hashes_by_rank.values()):
            raise IndexIntegrityError(f"{self.tier}: a rank holds a hash the hash map does not list it under")

    def _drop_holder(self, block: int, rank: K) -> None:
        holders = self.ranks_by_hash.get(block)
        if holders is None:
            return
        holders.discard(rank)
        if not holders:
            del self.ranks_by_hash[block]


class BlockIndex(Generic[K]):
    """Block hashes cached on each prefill rank, per tier, and in the shared store. Events of
    one rank must arrive in order."""

    def __init__(self) -> None:
        self._device: _RankTier[K] = _RankTier("device")
        self._host: _RankTier[K] = _RankTier("host")
        self._store: set[int] = set()

    def apply(self, rank: K, event: KVEvent) -> None:
        """Apply one event of ``rank``. Removing a hash the rank (or the store) does not hold is
        a no-op, so a snapshot (``AllBlocksCleared`` then ``BlockStored`` per tier) can follow
        any earlier state."""
        if isinstance(event, BlockStored):
            # The parent hash is not needed: chaining is already in every hash.
            if event.tier == "store":
                self._store.update(event.block_hashes)
            else:
                self._tier(event.tier).add(rank, event.block_hashes)
        elif isinstance(event, BlockRemoved):
            if event.tier == "store":
                self._store.difference_update(event.block_hashes)
            else:
                self._tier(event.tier).discard(rank, event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.remove_rank(rank)
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def apply_all(self, rank: K, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(rank, event)

    def remove_rank(self, rank: K) -> None:
        """Forget what ``rank`` holds itself (it left, or cleared its cache); the store stays."""
        self._device.remove_rank(rank)
        self._host.remove_rank(rank)

    def match_tiers(self, block_hashes: Sequence[int]) -> TieredMatch[K]:
        """Each rank's usable run of ``block_hashes``, split by tier.

        Walks the prompt once. A rank joins the walk at the first block it holds itself, with
        the blocks before it counted as store blocks (it can only have got there through the
        store); the walk stops at the first block that neither the store nor any rank still
        matching holds. Each step costs the ranks still matching, so the whole walk costs the
        matched depth times those ranks, not the prompt length times all ranks.
        """
        device_holders, host_holders, store = (
            self._device.ranks_by_hash,
            self._host.ranks_by_hash,
            self._store,
        )
        nobody: frozenset[K] = frozenset()
        running: dict[K, list[int]] = {}  # rank -> [device, host, store] so far
        done: dict[K, TierMatch] = {}
        store_run = 0  # leading blocks all in the store
        store_alive = True
        for depth, block in enumerate(block_hashes):
            on_device = device_holders.get(block, nobody)
            on_host = host_holders.get(block, nobody)
            in_store = block in store
            if store_alive:
                for rank in (*on_device, *on_host):
                    if rank not in running:
                        running[rank] = [0, 0, depth]
                if in_store:
                    store_run = depth + 1
                else:
                    store_alive = False
            for rank, counts in list(running.items()):
                if rank in on_device:
                    counts[0] += 1
                elif rank in on_host:
                    counts[1] += 1
                elif in_store:
                    counts[2] += 1
                else:
                    done[rank] = TierMatch(*counts)
                    del running[rank]
            if not store_alive and not running:
                break
        for rank, counts in running.items():
            done[rank] = TierMatch(*counts)
        return TieredMatch(done, store_run)

    def match(self, block_hashes: Sequence[int]) -> dict[K, int]:
        """Each rank's usable run (all tiers), for ranks holding one of its blocks themselves.
        With device events only, the leading blocks each rank holds."""
        return {rank: found.blocks for rank, found in self.match_tiers(block_hashes).by_rank.items()}

    def num_blocks(self, rank: K, tier: Tier = "device") -> int:
        """Blocks ``rank`` holds in ``tier`` now (0 for a rank the index never heard of); for
        ``store``, the store's blocks, which every rank can read."""
        if tier == "store":
            return len(self._store)
        return len(self._tier(tier).hashes_by_rank.get(rank, ()))

    def block_counts(self, tier: Tier = "device") -> dict[K, int]:
        return {rank: len(held) for rank, held in self._tier(tier).hashes_by_rank.items()}

    @property
    def ranks(self) -> list[K]:
        """Ranks the index holds blocks of, in either of their own tiers."""
        return sorted(set(self._device.hashes_by_rank) | set(self._host.hashes_by_rank))

    @property
    def num_distinct_blocks(self) -> int:
        """Distinct hashes on ranks' devices (the tier a rank computes into)."""
        return len(self._device.ranks_by_hash)

    @property
    def num_store_blocks(self) -> int:
        return len(self._store)

    def check_integrity(self) -> None:
        """Raise ``IndexIntegrityError`` unless each rank tier's two maps hold the same pairs."""
        self._device.check_integrity()
        self._host.check_integrity()

    def _tier(self, tier: Tier) -> _RankTier[K]:
        if tier == "device":
            return self._device
        if tier == "host":
            return self._host
        raise ValueError(f"tier {tier!r} is not a rank's own tier; choose one of {RANK_TIERS}")
