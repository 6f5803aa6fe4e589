"""Which prefill rank caches which block, rebuilt from the ranks' KV events.

Each prefill rank has its own prefix cache and reports every change to it as a ``KVEvent``.
The index keeps both directions of that relation::

    ranks_by_hash   h0 -> {p0-r0, p0-r1}   h1 -> {p0-r0}   h7 -> {p0-r1}
    hashes_by_rank  p0-r0 -> {h0, h1}      p0-r1 -> {h0, h7}

Invariant (``check_integrity``): the two maps describe the same set of (rank, hash) pairs, and
no hash maps to an empty set. Block hashes are chained (a hash names its whole prefix), so a
rank's match for a prompt is the run of the prompt's leading hashes it holds, up to the first
one it lacks, exactly as the rank's own ``PrefixCache.match_prefix`` walks its pages.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Generic

from tandem.router.rank_key import K
from tandem.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


class IndexIntegrityError(AssertionError):
    """The two maps of the index disagree: a bug in the index, not bad input."""


class BlockIndex(Generic[K]):
    """Block hashes cached on each prefill rank. Events of one rank must arrive in order."""

    def __init__(self) -> None:
        self._ranks_by_hash: dict[int, set[K]] = {}
        self._hashes_by_rank: dict[K, set[int]] = {}

    def apply(self, rank: K, event: KVEvent) -> None:
        """Apply one event of ``rank``. Removing a hash the rank does not hold is a no-op, so a
        snapshot (``AllBlocksCleared`` then ``BlockStored``) can follow any earlier state."""
        if isinstance(event, BlockStored):
            # The parent hash is not needed: chaining is already in every hash.
            held = self._hashes_by_rank.setdefault(rank, set())
            for block in event.block_hashes:
                if block not in held:
                    held.add(block)
                    self._ranks_by_hash.setdefault(block, set()).add(rank)
        elif isinstance(event, BlockRemoved):
            holding = self._hashes_by_rank.get(rank)
            if holding is None:
                return
            for block in event.block_hashes:
                if block in holding:
                    holding.discard(block)
                    self._drop_holder(block, rank)
        elif isinstance(event, AllBlocksCleared):
            self.remove_rank(rank)
        else:
            raise TypeError(f"not a KV event: {event!r}")

    def apply_all(self, rank: K, events: Iterable[KVEvent]) -> None:
        for event in events:
            self.apply(rank, event)

    def remove_rank(self, rank: K) -> None:
        """Forget everything ``rank`` cached (it left, or cleared its cache)."""
        for block in self._hashes_by_rank.pop(rank, set()):
            self._drop_holder(block, rank)

    def match(self, block_hashes: Sequence[int]) -> dict[K, int]:
        """Leading blocks of ``block_hashes`` each rank holds, for ranks holding at least one.

        Walks the prompt once, narrowing the set of ranks that still match, and stops as soon
        as none does: the cost is the matched depth, not the prompt length times the ranks.
        """
        matched: dict[K, int] = {}
        candidates: set[K] = set()
        for depth, block in enumerate(block_hashes):
            holders = self._ranks_by_hash.get(block)
            if holders is None:
                break
            if depth == 0:
                candidates = set(holders)
                continue
            for rank in candidates - holders:
                matched[rank] = depth
            candidates &= holders
            if not candidates:
                break
        else:
            depth = len(block_hashes)
        for rank in candidates:
            matched[rank] = depth
        return matched

    def num_blocks(self, rank: K) -> int:
        """Blocks ``rank`` caches now (0 for a rank the index never heard of)."""
        return len(self._hashes_by_rank.get(rank, ()))

    def block_counts(self) -> dict[K, int]:
        return {rank: len(held) for rank, held in self._hashes_by_rank.items()}

    @property
    def ranks(self) -> list[K]:
        return sorted(self._hashes_by_rank)

    @property
    def num_distinct_blocks(self) -> int:
        return len(self._ranks_by_hash)

    def check_integrity(self) -> None:
        """Raise ``IndexIntegrityError`` unless both maps hold the same (rank, hash) pairs."""
        pairs = 0
        for block, holders in self._ranks_by_hash.items():
            if not holders:
                raise IndexIntegrityError(f"hash {block:#x} maps to no rank")
            for rank in holders:
                if block not in self._hashes_by_rank.get(rank, ()):
                    raise IndexIntegrityError(f"hash {block:#x} lists {rank}, which does not hold it")
            pairs += len(holders)
        if pairs != sum(len(held) for held in self._hashes_by_rank.values()):
            raise IndexIntegrityError("a rank holds a hash the hash map does not list it under")

    def _drop_holder(self, block: int, rank: K) -> None:
        holders = self._ranks_by_hash.get(block)
        if holders is None:
            return
        holders.discard(rank)
        if not holders:
            del self._ranks_by_hash[block]
