"""What a rank's prefix cache tells the routers: blocks stored and removed, in which tier, and the
batches they travel in (``seq`` ordered per subscriber; a batch with ``reset`` starts from a
snapshot).

Each event names its tier: ``device`` (the rank's KV pages), ``host`` (the rank's host-memory
pool) or ``store`` (the shared store, readable by every rank). A block evicted from the device
to the host is a ``BlockRemoved(device)`` and a ``BlockStored(host)`` of the same hash: the
rank still holds it. ``AllBlocksCleared`` clears the rank's device and host tiers; what it
wrote to the store stays there."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, TypeAlias, get_args

from tandem.wire.messages import RankId

Tier: TypeAlias = Literal["device", "host", "store"]
TIERS: tuple[Tier, ...] = get_args(Tier)  # nearest first


@dataclass(frozen=True)
class BlockStored:
    """Consecutive pages of one prefix became cached; the first one's parent is ``parent_block_hash``."""

    block_hashes: tuple[int, ...]
    parent_block_hash: int | None
    page_size: int
    tier: Tier = "device"


@dataclass(frozen=True)
class BlockRemoved:
    """These hashes are no longer cached on this rank in ``tier``."""

    block_hashes: tuple[int, ...]
    tier: Tier = "device"


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
