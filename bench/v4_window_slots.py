"""What keeping the window KV and overlap of only a share of a DeepSeek-V4 rank's pages (window
slots, ``engine/window_slots.py``) does to its prefix-cache hits, at the same bytes of KV memory.

A share below 1 makes a page smaller (on V4-Flash 6.62 MiB at 1, 1.56 MiB at an eighth), so the
same memory caches more pages, but a hit can only land on a boundary whose last page still holds
a slot. ``python -m tandem.bench.v4_window_slots`` replays generated traces
(``bench/trace_gen.py``: long prompts over shared documents, and bursty short chat prompts)
through one prefill rank's real ``PrefixCache`` and ``WindowSlots`` (the page completions and
hit cuts the V4 runner makes), a request at a time, and prints for each share the pages the
memory holds and the share of prompt tokens served from the cache. A trace's 512-token blocks
become that many tokens (every token of a block the block's id), so equal block ids are equal
prefixes, as in the trace.

The rank's memory (``--kv-gib``) and its share of the traffic (``--rank-share``: one DEP16
prefill rank's sixteenth of the sessions) are parameters; the defaults are a V4-Flash DEP16
prefill rank's KV memory on a 141 GiB GPU (``tandem plan memory``) and its sixteenth."""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tandem.bench.trace_gen import (
    BLOCK_TOKENS,
    BurstyShortShape,
    LongPromptShape,
    bursty_short_trace,
    long_prompt_trace,
)
from tandem.engine.page_allocator import PageAllocator
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.window_slots import WindowSlots
from tandem.model.v4.config import V4Config
from tandem.model.v4.kv_layout import page_bytes, v4_kinds, v4_page_size, window_reach

FLASH = Path(__file__).resolve().parents[1] / "deploy" / "models" / "deepseek-v4-flash"
SHARES = (1.0, 0.5, 0.25, 0.125, 0.0625)


@dataclass(frozen=True)
class Replay:
    share: float
    page_bytes: int
    page_size: int
    pages: int
    prompt_tokens: int
    hit_tokens: int
    cut_tokens: int  # cached past the hit, not restorable there (computed again)

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def prompt_tokens(record: dict[str, Any]) -> list[int]:
    """A trace record's prompt: each 512-token block's tokens all its id."""
    tokens = [block for block in record["hash_ids"] for _ in range(BLOCK_TOKENS)]
    return tokens[: record["input_length"]]


def replay(
    records: Sequence[dict[str, Any]], cfg: V4Config, share: float, kv_bytes: int, page_size: int = 128
) -> Replay:
    """The records' prompts through one rank's prefix cache with window slots for ``share`` of
    the pages that ``kv_bytes`` hold."""
    size = v4_page_size(cfg, page_size)
    per_page = page_bytes(v4_kinds(cfg, 2, size, prefix_caching=True, window_share=share), size)
    num_pages = kv_bytes // per_page
    cache = PrefixCache(PageAllocator(num_pages), size)
    slots, reach = WindowSlots.for_share(math.ceil(share * num_pages), share), window_reach(cfg, size)
    written: set[int] = set()
    full_runs: list[int] = []

    def hit_pages(run: list[int]) -> int:
        full_runs.append(len(run))
        return slots.restorable(run, written, reach)

    cache.hit_pages = hit_pages
    cache.better_holder = slots.better_holder
    prompts = hits = cut = 0
    for record in records:
        tokens = prompt_tokens(record)
        full_runs.clear()
        found = cache.match(tokens)
        fresh = cache.allocate(math.ceil(len(tokens) / size) - len(found.page_ids))
        if fresh is None:
            raise ValueError(f"a prompt of {len(tokens)} tokens is more than {num_pages} pages of {size}")
        for page in fresh:  # filled again: no longer what filled it before
            written.discard(page)
            slots.release(page)
        pages = found.page_ids + fresh
        first, end = len(found.page_ids), len(tokens) // size
        keep = slots.to_keep(pages, first, end, reach)
        for page in pages[first:end]:  # completed, in order, the prompt in one step
            written.add(page)
            if page in keep:
                slots.take(page)
        cache.cache_full_pages(tokens, pages, len(tokens))
        cache.free(pages)
        prompts += len(tokens)
        hits += found.num_tokens
        cut += (full_runs[0] * size - found.num_tokens) if full_runs else 0
    return Replay(share, per_page, size, num_pages, prompts, hits, cut)


def traces(rank_share: float, duration_s: float | None = None) -> dict[str, list[dict[str, Any]]]:
    """Each trace shape's records for one rank's ``rank_share`` of the traffic."""
    long_shape, short_shape = LongPromptShape(), BurstyShortShape()
    long_shape = replace(long_shape, sessions_per_s=long_shape.sessions_per_s * rank_share)
    short_shape = replace(short_shape, requests_per_s=short_shape.requests_per_s * rank_share)
    if duration_s is not None:
        long_shape = replace(long_shape, duration_s=duration_s)
        short_shape = replace(short_shape, duration_s=duration_s)
    return {"long-prompt": long_prompt_trace(long_shape), "bursty-short": bursty_short_trace(short_shape)}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.v4_window_slots", description=__doc__)
    parser.add_argument("--model", type=Path, default=FLASH, help="a V4 model directory (its config.json)")
    parser.add_argument("--kv-gib", type=float, default=104.0, help="the rank's KV memory, GiB")
    parser.add_argument("--rank-share", type=float, default=1 / 16, help="the rank's share of the traffic")
    parser.add_argument("--duration-s", type=float, default=None, help="the traces' span (default: theirs)")
    args = parser.parse_args(argv)
    cfg = V4Config.from_dir(args.model)
    kv_bytes = int(args.kv_gib * 2**30)
    print(f"one V4 prefill rank, {args.kv_gib:g} GiB of KV, {args.rank_share:g} of each trace's traffic")
    print("trace         share   page MiB   pages    cached tokens  prompt tokens  hit     cut at a slot")
    for name, records in traces(args.rank_share, args.duration_s).items():
        for share in SHARES:
            r = replay(records, cfg, share, kv_bytes)
            print(
                f"{name:<13} {share:<7g} {r.page_bytes / 2**20:<10.2f} {r.pages:<8} "
                f"{r.pages * r.page_size:<14,} {r.prompt_tokens:<14,} {r.hit_rate:<7.1%} "
                f"{r.cut_tokens / max(r.prompt_tokens, 1):.1%}"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
