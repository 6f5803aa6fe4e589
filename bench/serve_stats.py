"""The figures of ``tandem bench serve``, computed from what the client saw (pure Python, no I/O).

Every time here is one clock's: the client's ``time.perf_counter`` when the request went out and
when each of its chunks arrived. A request's

* TTFT is its first chunk's arrival less its send;
* end-to-end is the arrival of its summary less its send;
* inter-token latencies are the gaps between its chunks, a chunk of ``k`` tokens (the frontend
  merges chunks for a slow reader) counting as ``k`` gaps of a ``k``-th each, so they sum to the
  time from the first token to the last;
* TPOT (time per output token) is ``(last token - first token) / (output tokens - 1)``, which is
  also the mean of its inter-token latencies; interactivity is ``1000 / TPOT ms``, the tokens a
  second one user sees.

A request meets the SLOs (goodput) when it completed, its TTFT is at most ``slo_ttft_ms`` and
its mean inter-token latency (its TPOT) at most ``slo_itl_ms``; a request of one output token
has no gap and meets the ITL SLO.

Token throughputs count completed requests' bills (cached and new prompt tokens, output
tokens) over the point's wall time, from its first send to its last arrival. The cache-hit share
is cached over prompt tokens, in all and by the tier the cached tokens came from (the prefill
rank's device pages, its host-memory pool, the shared store); new prompt tokens are those the
prefill ranks computed. The composition is
the mean, over completed requests, of each field of the bill's ``Latency``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.wire.messages import CachedByTier

# the bill's Latency fields, in the order a request meets them; ttft_s, rank_s and e2e_s last
COMPOSITION_FIELDS = (
    "queue_s",
    "routing_s",
    "pickup_s",
    "reservation_wait_s",
    "prefill_pickup_s",
    "prefill_queue_s",
    "prefill_compute_s",
    "kv_transfer_s",
    "kv_transfer_exposed_s",
    "kv_wait_s",
    "kv_accept_s",
    "decode_s",
    "ttft_s",
    "rank_s",
    "e2e_s",
)
# the parts of the time to first token, stacked in the TTFT figure: frontend, decode rank's wait
# for pages, then inside the KV wait what the prefill rank measured
TTFT_PARTS = (
    "queue_s",
    "routing_s",
    "pickup_s",
    "reservation_wait_s",
    "prefill_pickup_s",
    "prefill_queue_s",
    "prefill_compute_s",
    "kv_transfer_exposed_s",
    "kv_accept_s",
)


@dataclass
class RequestRecord:
    """One request as the client saw it: its send, its chunks' arrivals and its bill."""

    sent_s: float
    # (arrival, tokens in the chunk), in order
    chunks: list[tuple[float, int]] = field(default_factory=list)
    done_s: float | None = None
    error: str | None = None  # a failed call, an error summary, or a stream without a summary
    prompt_tokens: int = 0
    cached_tokens: int = 0
    cached_tokens_by_tier: CachedByTier = field(default_factory=CachedByTier)  # their sum: cached_tokens
    new_prompt_tokens: int = 0
    output_tokens: int = 0
    predicted_cached_tokens: int = 0
    latency_s: dict[str, float] = field(default_factory=dict)  # the bill's Latency fields
    prefill_rank: str = ""
    decode_rank: str = ""
    draft_tokens: int = 0  # the bill's speculation: drafts proposed, accepted, decode steps
    accepted_tokens: int = 0
    decode_steps: int = 0

    @property
    def completed(self) -> bool:
        return self.error is None and self.done_s is not None and bool(self.chunks)

    @property
    def ttft_s(self) -> float:
        return self.chunks[0][0] - self.sent_s

    @property
    def e2e_s(self) -> float:
        assert self.done_s is not None
        return self.done_s - self.sent_s

    @property
    def itls_s(self) -> list[float]:
        gaps: list[float] = []
        first_arrival, first_tokens = self.chunks[0]
        gaps += [0.0] * (first_tokens - 1)  # tokens that came with the first one
        previous = first_arrival
        for arrival, tokens in self.chunks[1:]:
            gaps += [(arrival - previous) / tokens] * tokens
            previous = arrival
        return gaps

    @property
    def tpot_s(self) -> float | None:
        tokens = sum(n for _, n in self.chunks)
        if tokens < 2:
            return None
        return (self.chunks[-1][0] - self.chunks[0][0]) / (tokens - 1)


@dataclass(frozen=True)
class Pools:
    """The deployment's rank counts, from ``ClusterStatus``. A colocated rank both prefills and
    decodes: it counts once in ``ranks`` and in each role's per-rank figures."""

    prefill_ranks: int
    decode_ranks: int
    colocated_ranks: int = 0

    @property
    def ranks(self) -> int:
        return self.prefill_ranks + self.decode_ranks + self.colocated_ranks

    @property
    def prefilling(self) -> int:
        return self.prefill_ranks + self.colocated_ranks

    @property
    def decoding(self) -> int:
        return self.decode_ranks + self.colocated_ranks


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks (numpy's
    default); NaN for no values."""
    if not 0 <= q <= 100:
        raise ValueError(f"q: must be in [0, 100], got {q}")
    if not values:
        return math.nan
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def spread_ms(values_s: Sequence[float]) -> dict[str, float]:
    """P50, P90 and P99 in milliseconds (NaN when there are no values)."""
    return {f"p{q}": percentile(values_s, q) * 1e3 for q in (50, 90, 99)}


def meets_slo(record: RequestRecord, slo_ttft_ms: float, slo_itl_ms: float) -> bool:
    """Completed, TTFT within ``slo_ttft_ms`` and mean inter-token latency within ``slo_itl_ms``."""
    if not record.completed:
        return False
    tpot = record.tpot_s
    return record.ttft_s * 1e3 <= slo_ttft_ms and (tpot is None or tpot * 1e3 <= slo_itl_ms)


def composition_ms(records: Sequence[RequestRecord]) -> dict[str, float]:
    """The mean of each bill latency field over ``records``, in ms (``queue_s`` -> ``queue``)."""
    out = {}
    for name in COMPOSITION_FIELDS:
        values = [r.latency_s.get(name, 0.0) for r in records]
        out[name.removesuffix("_s")] = sum(values) / len(values) * 1e3 if values else math.nan
    return out


def _per(value: float, count: float) -> float:
    return value / count if count else math.nan


def point_stats(
    records: Sequence[RequestRecord],
    wall_s: float,
    pools: Pools,
    slo_ttft_ms: float,
    slo_itl_ms: float,
    concurrency: int | None = None,
) -> dict[str, Any]:
    """One point's figures (the JSON ``points`` entry); ``wall_s`` from first send to last arrival."""
    if not wall_s > 0:
        raise ValueError(f"wall_s: must be > 0, got {wall_s}")
    done = [r for r in records if r.completed]
    failed = [r for r in records if not r.completed]
    cached = sum(r.cached_tokens for r in done)
    by_tier = CachedByTier()
    for r in done:
        by_tier = by_tier.plus(r.cached_tokens_by_tier)
    new = sum(r.new_prompt_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done)
    output = sum(r.output_tokens for r in done)
    tpots = [t for r in done if (t := r.tpot_s) is not None]
    tpot = spread_ms(tpots)
    input_per_s = {"cached": cached / wall_s, "new": new / wall_s}
    output_per_s = output / wall_s
    return {
        "concurrency": concurrency,
        "requests": len(records),
        "completed": len(done),
        "failed": len(failed),
        "errors": sorted({r.error for r in failed if r.error})[:5],
        "wall_s": wall_s,
        "output_tokens": output,
        "request_throughput": len(done) / wall_s,
        "goodput_rps": sum(meets_slo(r, slo_ttft_ms, slo_itl_ms) for r in done) / wall_s,
        "slo": {"ttft_ms": slo_ttft_ms, "itl_ms": slo_itl_ms},
        "input_tokens_per_s": input_per_s,
        "output_tokens_per_s": output_per_s,
        "per_rank": {
            "input_tokens_per_s": _per(cached + new, pools.ranks * wall_s),
            "output_tokens_per_s": _per(output, pools.ranks * wall_s),
        },
        "per_prefill_rank": {k: _per(v, pools.prefilling) for k, v in input_per_s.items()},
        "per_decode_rank": {"output_tokens_per_s": _per(output_per_s, pools.decoding)},
        "ttft_ms": spread_ms([r.ttft_s for r in done]),
        "itl_ms": spread_ms([gap for r in done for gap in r.itls_s]),
        "tpot_ms": tpot,
        "e2e_ms": spread_ms([r.e2e_s for r in done]),
        "interactivity_tokens_per_s": 1e3 / tpot["p50"] if tpots and tpot["p50"] > 0 else math.nan,
        "composition_ms": composition_ms(done),
        "cache_hit_share": _per(cached, prompt),
        "cache_hit_share_by_tier": {tier: _per(n, prompt) for tier, n in by_tier.as_dict().items()},
        "predicted_cached_tokens": sum(r.predicted_cached_tokens for r in done),
        "cached_tokens": cached,
        "cached_tokens_by_tier": by_tier.as_dict(),
        "new_prompt_tokens": new,
        "prompt_tokens": prompt,
        "speculation": speculation_stats(done),
    }


def speculation_stats(records: Sequence[RequestRecord]) -> dict[str, float]:
    """The bills' drafts over a point: proposed, accepted, decode steps, and the mean acceptance
    length (output tokens per decode step over all of them; 1.0 without speculation)."""
    drafts = sum(r.draft_tokens for r in records)
    accepted = sum(r.accepted_tokens for r in records)
    steps = sum(r.decode_steps for r in records)
    return {
        "draft_tokens": drafts,
        "accepted_tokens": accepted,
        "decode_steps": steps,
        "acceptance_length": (steps + accepted) / steps if steps else math.nan,
        "acceptance_rate": accepted / drafts if drafts else math.nan,
    }
