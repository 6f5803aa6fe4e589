"""A KV pool of token ids for scheduler tests: a chunk's tokens are written through its page
table and a sampling chunk's context is read back through it, so a wrong or overwritten page
changes the outputs."""

from __future__ import annotations

from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.scheduler_output import ScheduledChunk


class SimulatedKV:
    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.slots: dict[tuple[int, int], int] = {}

    def write(self, chunk: ScheduledChunk, cache: PrefixCache) -> list[int] | None:
        """Write ``chunk``; the context up to its end when it samples, else ``None``."""
        size = self.page_size
        end = chunk.start_position + len(chunk.token_ids)
        for position, token in enumerate(chunk.token_ids, chunk.start_position):
            page = chunk.page_ids[position // size]
            assert cache.refcount(page) == 1 and not cache.is_cached(page), "write to a shared page"
            self.slots[page, position % size] = token
        if not chunk.sample:
            return None
        return [self.slots[chunk.page_ids[p // size], p % size] for p in range(end)]
