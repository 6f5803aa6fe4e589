"""What a rank's prefix cache tells the routers: blocks stored and removed, and the batches they
travel in (``seq`` ordered per subscriber; a batch with ``reset`` starts from a snapshot)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from tandem.wire.messages import RankId


@dataclass(frozen=True)
class BlockStored:
    """Consecutive pages of one prefix became cached; the first one's parent is ``parent_block_hash``."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    page_size: int


@dataclass(frozen=True)
class BlockRemoved:
    """These hashes are no longer cached on this rank."""

    block_hashes: tuple[int, ...]


@dataclass(frozen=True)
class AllBlocksCleared:
    """Every hash this rank cached is gone."""


KVEvent: TypeAlias = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True)
class KVEventBatch:
    rank: RankId
    incarnation: int  # of the rank: a rebuilt rank starts a new sequence
    seq: int
    reset: bool
    events: list[KVEvent] = field(default_factory=list)
