"""A simulated prefill rank's KV tiers for the router bench: device and host LRUs, a shared store.

::

    device LRU (capacity_blocks)  ──evict──▶  host LRU (host_capacity_blocks)  ──evict──▶ gone
         ▲ a host hit moves back at prefill end       (none at 0: a device eviction is gone)
    shared store (every rank writes the blocks it computes, every rank reads; LRU or unbounded)

Each change is the ``KVEvent`` a real rank sends (``wire.kv_events``): a device eviction to the
host is ``BlockRemoved(device)`` + ``BlockStored(host)``, a host eviction ``BlockRemoved(host)``,
a store write ``BlockStored(store)`` and a store eviction ``BlockRemoved(store)`` from the rank
whose write caused it. A rank matches when a request starts, as a real rank's prefix cache does:
the prompt's leading blocks each in its device, its host or the store, up to the first in none,
each counted in the nearest tier holding it, at most ``(prompt - 1) // 512``. It loads a tier's
blocks only when loading them is faster than computing them (``TierSpeeds.loads``); otherwise
it computes them again. The tiers are exclusive on a rank: a block is on its device or its host.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.router.index import TierMatch
from tandem.router.policy import HOST_LOAD_BYTES_PER_S, KV_BYTES_PER_TOKEN, STORE_LOAD_BYTES_PER_S
from tandem.wire.kv_events import BlockRemoved, BlockStored, KVEvent, Tier

BLOCK_TOKENS = 512
# Tokens a second a rank loads: the policy's bandwidths over DeepSeek-V3's 70,272-byte tokens.
DEFAULT_HOST_LOAD_TOKENS_PER_S = HOST_LOAD_BYTES_PER_S / KV_BYTES_PER_TOKEN  # 25 GB/s: 355,760
DEFAULT_STORE_LOAD_TOKENS_PER_S = STORE_LOAD_BYTES_PER_S / KV_BYTES_PER_TOKEN  # 5 GB/s: 71,152


@dataclass(frozen=True)
class TierSpeeds:
    """What a simulated rank computes and loads in a second, in tokens."""

    prefill_tokens_per_s: float
    host_load_tokens_per_s: float = DEFAULT_HOST_LOAD_TOKENS_PER_S
    store_load_tokens_per_s: float = DEFAULT_STORE_LOAD_TOKENS_PER_S

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "host_load_tokens_per_s", "store_load_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, got {getattr(self, name)}")

    def cost(self, tier: Tier) -> float:
        """Time to load a token from ``tier`` over the time to compute it (the router's price)."""
        if tier == "device":
            return 0.0
        rate = self.host_load_tokens_per_s if tier == "host" else self.store_load_tokens_per_s
        return self.prefill_tokens_per_s / rate

    def loads(self, tier: Tier) -> bool:
        """The rank's own rule: load a tier's blocks only when that beats computing them."""
        return self.cost(tier) < 1.0

    def service_s(self, computed_tokens: int, used: TierMatch) -> float:
        """Compute the new tokens, then load the used host and store blocks (no overlap)."""
        return (
            computed_tokens / self.prefill_tokens_per_s
            + used.host * BLOCK_TOKENS / self.host_load_tokens_per_s
            + used.store * BLOCK_TOKENS / self.store_load_tokens_per_s
        )


class SharedStore:
    """One store every rank reads and writes: LRU over ``capacity_blocks``, or unbounded."""

    def __init__(self, capacity_blocks: int | None = None) -> None:
        if capacity_blocks is not None and capacity_blocks < 1:
            raise ValueError(f"--store-capacity-blocks must be at least 1, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __contains__(self, block: int) -> bool:
        return block in self._blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def touch(self, block: int) -> None:
        self._blocks.move_to_end(block)

    def write(self, blocks: Sequence[int]) -> tuple[list[int], list[int]]:
        """Write the blocks it lacks; (written, evicted)."""
        written = [block for block in blocks if block not in self._blocks]
        for block in written:
            self._blocks[block] = None
        evicted: list[int] = []
        if self.capacity_blocks is not None:
            while len(self._blocks) > self.capacity_blocks:
                evicted.append(self._blocks.popitem(last=False)[0])
        return written, evicted


class RankTiers:
    """One simulated prefill rank's device and host LRUs, and its view of the shared store."""

    def __init__(
        self, capacity_blocks: int, host_capacity_blocks: int = 0, store: SharedStore | None = None
    ) -> None:
        if capacity_blocks < 1:
            raise ValueError(f"--capacity-blocks must be at least 1, got {capacity_blocks}")
        if host_capacity_blocks < 0:
            raise ValueError(f"--host-capacity-blocks must be >= 0, got {host_capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self.host_capacity_blocks = host_capacity_blocks
        self.store = store
        self._device: OrderedDict[int, None] = OrderedDict()  # first = least recently used
        self._host: OrderedDict[int, None] = OrderedDict()

    def match(self, blocks: Sequence[int]) -> TierMatch:
        """The usable run of ``blocks`` (already capped by the caller), split by the nearest
        tier holding each; device and store hits become most recent."""
        device = host = store = 0
        for block in blocks:
            if block in self._device:
                self._device.move_to_end(block)
                device += 1
            elif block in self._host:
                host += 1
            elif self.store is not None and block in self.store:
                self.store.touch(block)
                store += 1
            else:
                break
        return TierMatch(device, host, store)

    def complete(self, blocks: Sequence[int], computed_from: int) -> list[KVEvent]:
        """A prefill of these full blocks ended: all are on the device now (host hits move
        back), the ones from ``computed_from`` on were computed here and go to the store, and
        the least recent device blocks beyond capacity go to the host. The events, in order."""
        events: list[KVEvent] = []
        moved_up = [block for block in blocks if block in self._host]
        if moved_up:
            for block in moved_up:
                del self._host[block]
            events.append(BlockRemoved(tuple(moved_up), "host"))
        run: list[int] = []
        parent: int | None = None
        run_parent: int | None = None
        for block in blocks:
            if block in self._device:
                self._device.move_to_end(block)
                if run:
                    events.append(BlockStored(tuple(run), run_parent, BLOCK_TOKENS))
                    run = []
            else:
                self._device[block] = None
                if not run:
                    run_parent = parent
                run.append(block)
            parent = block
        if run:
            events.append(BlockStored(tuple(run), run_parent, BLOCK_TOKENS))
        if self.store is not None and computed_from < len(blocks):
            written, dropped = self.store.write(blocks[computed_from:])
            if written:
                first = blocks.index(written[0])
                events.append(
                    BlockStored(tuple(written), blocks[first - 1] if first else None, BLOCK_TOKENS, "store")
                )
            if dropped:
                events.append(BlockRemoved(tuple(dropped), "store"))
        evicted = [
            self._device.popitem(last=False)[0] for _ in range(len(self._device) - self.capacity_blocks)
        ]
        if evicted:
            events.append(BlockRemoved(tuple(evicted), "device"))
            if self.host_capacity_blocks:
                for block in evicted:
                    self._host[block] = None
                events.append(BlockStored(tuple(evicted), None, BLOCK_TOKENS, "host"))
                gone = [
                    self._host.popitem(last=False)[0]
                    for _ in range(len(self._host) - self.host_capacity_blocks)
                ]
                if gone:
                    events.append(BlockRemoved(tuple(gone), "host"))
        return events

    def num_blocks(self, tier: Tier) -> int:
        if tier == "store":
            return len(self.store) if self.store is not None else 0
        return len(self._device if tier == "device" else self._host)
