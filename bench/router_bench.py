"""Replay a Mooncake trace through the real ``Router`` over simulated prefill ranks.

Each simulated prefill rank has an LRU prefix cache of ``capacity_blocks`` blocks of 512 tokens
(the trace's block size, used as the page size) that reports every change as ``BlockStored`` /
``BlockRemoved`` events, fed to the router with ``apply_events``: the router's index is what
real ranks would send. A rank serves its queue first come first served, computing only the
uncached tokens at ``prefill_tokens_per_s``; its cache is matched when the request starts (the
rank's own rule: leading blocks up to the first miss, at most ``(prompt - 1) // 512``) and the
request's full blocks are stored when its prefill completes, which is also when the router
hears ``prefill_done``. Decode ranks have ample room; a request finishes after
``output_length`` steps of ``DECODE_STEP_S``.

The same replay runs with the ``round_robin`` policy (same caches, same service), and two
cache bounds are computed without ranks: the oracle, one infinite cache shared by everyone
(36.6% of the blocks on the conversation trace), and one LRU cache shared by everyone with the
ranks' total capacity (what any routing over caches of that total size can hope for).

Defaults, for DeepSeek-V3 on H200s:

* ``capacity_blocks`` = 1,600 per rank. A rank of a DEP16 prefill group holds its attention,
  dense and shared-expert weights whole (~15 GB in FP8), a sixteenth of the routed experts
  (~41 GB) and bf16 embeddings (~4 GB): ~60 GB of 141 GB. After ~20 GB of activations and
  communication buffers about 58 GB hold KV; the MLA latent cache is 61 layers x (512 + 64) x
  2 bytes = 70,272 bytes a token, so ~820k tokens = 1,600 blocks of 512.
* ``prefill_tokens_per_s`` = 6,000 uncached tokens a second per rank (an H200 prefilling
  DeepSeek-V3 in a DEP group does several thousand). The trace's 144.8M prompt tokens over
  59 minutes are 41k tokens/s, so 8 ranks run at ~85% busy without any cache and ~65% with the
  cache-aware router's hits.

Finite caches bound what any routing can reach against the infinite oracle: one LRU shared by
all 8 ranks at 1,600 blocks each hits 0.245 (0.67 of the oracle's 0.366); it takes ~40k blocks
in all for 0.95 of the oracle, more than 8 x 141 GB of nothing but KV (8 x 3,900 blocks: 0.91).
Measured with ``tandem bench router --trace ../shared/traces/mooncake-conversation.jsonl
--prefill-ranks 8``: router 0.237 (0.97 of the shared LRU, 0.65 of the oracle), round-robin
0.075; with ``--capacity-blocks 8000`` (~290 GB a rank, the size of a host-memory tier) the
router reaches 0.356, 0.97 of the oracle.

Hit rates count blocks as the trace does: each request's ``hash_ids``, its last partial block
included, against the blocks found cached when its prefill starts. Load balance is reported two
ways, each as max/mean over the ranks: the router's in-flight tokens averaged over time, and the
tokens each rank computed. TTFT here is arrival to prefill done (queue and compute, no transfer).
"""

from __future__ import annotations

import heapq
import json
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.router.policy import PolicyConfig
from tandem.router.registry import DEFAULT_POLICY, PREFILL_POLICIES, UnknownPolicy
from tandem.router.router import Router, RouterConfig
from tandem.wire.kv_events import BlockRemoved, BlockStored, KVEvent

BLOCK_TOKENS = 512
DEFAULT_CAPACITY_BLOCKS = 1_600
DEFAULT_PREFILL_TOKENS_PER_S = 6_000.0
DECODE_STEP_S = 0.03
_DECODE_RANKS = 4
_DECODE_PAGES = 1 << 40  # ample: decode capacity is not what this benchmark measures


class TraceError(ValueError):
    """The trace cannot be read; the message names the file, the line and the field."""


@dataclass(frozen=True)
class TraceRequest:
    arrival_s: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]  # one per 512-token block; the last may be partial

    @property
    def full_blocks(self) -> tuple[int, ...]:
        return self.hash_ids[: self.input_length // BLOCK_TOKENS]

    @property
    def max_reusable_blocks(self) -> int:
        return (self.input_length - 1) // BLOCK_TOKENS


def read_trace(path: Path) -> list[TraceRequest]:
    """Requests of a Mooncake-format JSONL trace in arrival order (blank lines are skipped)."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from exc
    requests: list[TraceRequest] = []
    for lineno, line in enumerate(lines, start=1):
        if line.strip():
            requests.append(_parse_line(line, f"{path}:{lineno}"))
    if not requests:
        raise TraceError(f"{path}: the trace holds no requests")
    requests.sort(key=lambda r: r.arrival_s)  # stable: equal timestamps keep file order
    return requests


def _parse_line(line: str, where: str) -> TraceRequest:
    try:
        record = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from exc
    if not isinstance(record, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(record).__name__}")

    def number(name: str, minimum: int, integer: bool) -> float:
        if name not in record:
            raise TraceError(f"{where}: field '{name}' is missing")
        value = record[name]
        kinds = (int,) if integer else (int, float)
        if isinstance(value, bool) or not isinstance(value, kinds) or not minimum <= value < math.inf:
            kind = "an integer" if integer else "a number"
            raise TraceError(f"{where}: field '{name}' must be {kind} >= {minimum}, got {value!r}")
        return value

    timestamp_ms = number("timestamp", 0, integer=False)
    input_length = int(number("input_length", 1, integer=True))
    output_length = int(number("output_length", 0, integer=True))
    hash_ids = record.get("hash_ids")
    if not isinstance(hash_ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) for h in hash_ids
    ):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of integers, got {hash_ids!r:.80}")
    low, high = input_length // BLOCK_TOKENS, math.ceil(input_length / BLOCK_TOKENS)
    if not low <= len(hash_ids) <= high:
        raise TraceError(
            f"{where}: field 'hash_ids' has {len(hash_ids)} ids; input_length {input_length} "
            f"needs {low}..{high} blocks of {BLOCK_TOKENS}"
        )
    return TraceRequest(timestamp_ms / 1000.0, input_length, output_length, tuple(hash_ids))


class _RankCache:
    """One simulated prefill rank's prefix cache: blocks in LRU order, events as a real one sends."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()  # first = least recently used

    def match(self, request: TraceRequest) -> int:
        """Leading cached blocks, capped as the rank caps them; they become most recent."""
        matched = 0
        for block in request.full_blocks[: request.max_reusable_blocks]:
            if block not in self._blocks:
                break
            self._blocks.move_to_end(block)
            matched += 1
        return matched

    def store(self, request: TraceRequest) -> list[KVEvent]:
        """Cache the request's full blocks, evicting the least recently used beyond capacity."""
        events: list[KVEvent] = []
        run: list[int] = []
        parent: int | None = None
        run_parent: int | None = None
        for block in request.full_blocks:
            if block in self._blocks:
                self._blocks.move_to_end(block)
                if run:
                    events.append(BlockStored(tuple(run), run_parent, BLOCK_TOKENS))
                    run = []
            else:
                self._blocks[block] = None
                if not run:
                    run_parent = parent
                run.append(block)
            parent = block
        if run:
            events.append(BlockStored(tuple(run), run_parent, BLOCK_TOKENS))
        evicted = [
            self._blocks.popitem(last=False)[0] for _ in range(len(self._blocks) - self.capacity_blocks)
        ]
        if evicted:
            events.append(BlockRemoved(tuple(evicted)))
        return events


@dataclass
class _Rank:
    cache: _RankCache
    queue: deque[tuple[str, TraceRequest, float]] = field(default_factory=deque)
    busy: bool = False
    computed_tokens: int = 0
    load_area: float = 0.0  # integral of the router's in-flight tokens over time


@dataclass(frozen=True)
class SimResult:
    policy: str
    hit_rate: float
    token_hit_rate: float
    time_avg_load_max_over_mean: float
    computed_tokens_max_over_mean: float
    utilisation: float  # computed tokens over what the ranks could compute while requests arrive
    mean_ttft_s: float
    p99_ttft_s: float
    prediction_exact_share: float  # requests whose predicted cached tokens were found at start
    counters: dict[str, int]


def simulate(
    trace: Sequence[TraceRequest],
    num_prefill_ranks: int,
    capacity_blocks: int,
    prefill_tokens_per_s: float,
    policy: str,
    policy_config: PolicyConfig | None = None,
) -> SimResult:
    router = Router(RouterConfig(policy=policy, policy_config=policy_config or PolicyConfig()))
    names = [f"prefill0-r{i}" for i in range(num_prefill_ranks)]
    router.set_ranks(names, [f"decode0-r{i}" for i in range(_DECODE_RANKS)])
    for rank in router.decode_ranks:
        router.update_decode_stats(rank, _DECODE_PAGES, 0, _DECODE_PAGES)
    ranks = {name: _Rank(_RankCache(capacity_blocks)) for name in names}
    timers: list[tuple[float, int, str, str, str]] = []  # (time, seq, kind, request id, rank)
    started: dict[str, tuple[TraceRequest, float, int]] = {}  # id -> request, arrival, blocks found
    predicted: dict[str, int] = {}
    ttfts: list[float] = []
    totals = {"blocks": 0, "hit_blocks": 0, "tokens": 0, "hit_tokens": 0, "exact": 0}
    clock = 0.0
    seq = 0

    def advance(now: float) -> None:
        nonlocal clock
        if now > clock:
            for name, load in router.loads().prefill_tokens.items():
                ranks[name].load_area += load * (now - clock)
            clock = now

    def start_next(name: str, now: float) -> None:
        nonlocal seq
        rank = ranks[name]
        if rank.busy or not rank.queue:
            return
        request_id, request, arrival = rank.queue.popleft()
        found = rank.cache.match(request)
        new_tokens = request.input_length - found * BLOCK_TOKENS
        rank.busy, rank.computed_tokens = True, rank.computed_tokens + new_tokens
        started[request_id] = (request, arrival, found)
        seq += 1
        heapq.heappush(timers, (now + new_tokens / prefill_tokens_per_s, seq, "prefill", request_id, name))

    def fire(now: float, kind: str, request_id: str, name: str) -> None:
        nonlocal seq
        advance(now)
        if kind == "decode":
            router.finished(request_id)
            return
        request, arrival, found = started.pop(request_id)
        router.apply_events(name, ranks[name].cache.store(request))
        router.prefill_done(request_id)
        ttfts.append(now - arrival)
        totals["blocks"] += len(request.hash_ids)
        totals["hit_blocks"] += found
        totals["tokens"] += request.input_length
        totals["hit_tokens"] += found * BLOCK_TOKENS
        totals["exact"] += predicted.pop(request_id) == found
        ranks[name].busy = False
        seq += 1
        heapq.heappush(timers, (now + request.output_length * DECODE_STEP_S, seq, "decode", request_id, ""))
        start_next(name, now)

    for number, request in enumerate(trace):
        while timers and timers[0][0] <= request.arrival_s:
            when, _, kind, request_id, name = heapq.heappop(timers)
            fire(when, kind, request_id, name)
        advance(request.arrival_s)
        request_id = f"req{number}"
        decision = router.route(
            request_id, request.full_blocks, request.input_length, BLOCK_TOKENS, request.output_length
        )
        predicted[request_id] = decision.matched_blocks
        ranks[decision.prefill_rank].queue.append((request_id, request, request.arrival_s))
        start_next(decision.prefill_rank, request.arrival_s)
    while timers:
        when, _, kind, request_id, name = heapq.heappop(timers)
        fire(when, kind, request_id, name)
    router.check_integrity()
    if router.num_in_flight:
        raise AssertionError(f"{router.num_in_flight} requests still in flight after the replay")

    duration = max(clock, 1e-9)
    areas = [rank.load_area / duration for rank in ranks.values()]
    computed = [rank.computed_tokens for rank in ranks.values()]
    ttfts.sort()
    return SimResult(
        policy=policy,
        hit_rate=totals["hit_blocks"] / totals["blocks"],
        token_hit_rate=totals["hit_tokens"] / totals["tokens"],
        time_avg_load_max_over_mean=_max_over_mean(areas),
        computed_tokens_max_over_mean=_max_over_mean(computed),
        utilisation=sum(computed)
        / (prefill_tokens_per_s * num_prefill_ranks * max(trace[-1].arrival_s, 1e-9)),
        mean_ttft_s=statistics.fmean(ttfts),
        p99_ttft_s=ttfts[min(len(ttfts) - 1, math.ceil(0.99 * len(ttfts)) - 1)],
        prediction_exact_share=totals["exact"] / len(trace),
        counters=router.counters(),
    )


def _max_over_mean(values: Sequence[float]) -> float:
    mean = statistics.fmean(values)
    return max(values) / mean if mean > 0 else 1.0


def shared_cache_hit_rate(trace: Sequence[TraceRequest], capacity_blocks: int | None) -> float:
    """Block hit rate of one cache shared by all requests (``None``: infinite; else LRU),
    with the ranks' rule: leading blocks up to the first miss, one token always computed."""
    cache: OrderedDict[int, None] = OrderedDict()
    hit = total = 0
    for request in trace:
        for block in request.full_blocks[: request.max_reusable_blocks]:
            if block not in cache:
                break
            cache.move_to_end(block)
            hit += 1
        total += len(request.hash_ids)
        for block in request.full_blocks:
            cache[block] = None
            cache.move_to_end(block)
        if capacity_blocks is not None:
            while len(cache) > capacity_blocks:
                cache.popitem(last=False)
    return hit / total


def run_router_bench(
    trace_path: Path,
    prefill_ranks: int = 8,
    capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS,
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S,
    policy: str = DEFAULT_POLICY,
) -> dict[str, Any]:
    """Replay ``trace_path`` with ``policy`` and with round-robin; the report as a dict."""
    if prefill_ranks < 1:
        raise ValueError(f"--prefill-ranks must be at least 1, got {prefill_ranks}")
    if capacity_blocks < 1:
        raise ValueError(f"--capacity-blocks must be at least 1, got {capacity_blocks}")
    if not prefill_tokens_per_s > 0:
        raise ValueError(f"--prefill-tokens-per-s must be positive, got {prefill_tokens_per_s}")
    if policy not in PREFILL_POLICIES:
        raise UnknownPolicy(policy)
    trace = read_trace(trace_path)
    routed = simulate(trace, prefill_ranks, capacity_blocks, prefill_tokens_per_s, policy)
    baseline = simulate(trace, prefill_ranks, capacity_blocks, prefill_tokens_per_s, "round_robin")
    oracle = shared_cache_hit_rate(trace, None)
    shared_lru = shared_cache_hit_rate(trace, capacity_blocks * prefill_ranks)
    return {
        "parameters": {
            "trace": str(trace_path),
            "requests": len(trace),
            "prefill_ranks": prefill_ranks,
            "capacity_blocks": capacity_blocks,
            "block_tokens": BLOCK_TOKENS,
            "prefill_tokens_per_s": prefill_tokens_per_s,
            "policy": policy,
        },
        "hit_rate": {
            "router": routed.hit_rate,
            "round_robin": baseline.hit_rate,
            "oracle": oracle,
            "shared_lru_same_capacity": shared_lru,
            "router_over_oracle": routed.hit_rate / oracle if oracle else 0.0,
            "router_over_shared_lru": routed.hit_rate / shared_lru if shared_lru else 0.0,
        },
        "router": _summary(routed),
        "round_robin": _summary(baseline),
    }


def _summary(result: SimResult) -> dict[str, Any]:
    return {
        "hit_rate": result.hit_rate,
        "token_hit_rate": result.token_hit_rate,
        "time_avg_in_flight_tokens_max_over_mean": result.time_avg_load_max_over_mean,
        "computed_tokens_max_over_mean": result.computed_tokens_max_over_mean,
        "utilisation": result.utilisation,
        "mean_ttft_s": result.mean_ttft_s,
        "p99_ttft_s": result.p99_ttft_s,
        "prediction_exact_share": result.prediction_exact_share,
        "counters": result.counters,
    }


def format_report(report: dict[str, Any]) -> str:
    params, hits = report["parameters"], report["hit_rate"]
    lines = [
        f"trace {params['trace']}: {params['requests']} requests, {params['prefill_ranks']} prefill ranks, "
        f"{params['capacity_blocks']} blocks of {params['block_tokens']} tokens each, "
        f"{params['prefill_tokens_per_s']:.0f} tokens/s each, policy {params['policy']}",
        f"block hit rate: router {hits['router']:.4f}  round-robin {hits['round_robin']:.4f}  "
        f"oracle {hits['oracle']:.4f}  one shared LRU of the ranks' total size "
        f"{hits['shared_lru_same_capacity']:.4f}",
        f"router / oracle {hits['router_over_oracle']:.3f}  "
        f"router / shared LRU {hits['router_over_shared_lru']:.3f}",
        "",
        f"{'':12} {'in-flight max/mean':>18} {'computed max/mean':>18} {'busy':>6} {'TTFT mean':>10} "
        f"{'TTFT p99':>9}",
    ]
    for name in ("router", "round_robin"):
        s = report[name]
        lines.append(
            f"{name:12} {s['time_avg_in_flight_tokens_max_over_mean']:>18.3f} "
            f"{s['computed_tokens_max_over_mean']:>18.3f} {s['utilisation']:>6.1%} "
            f"{s['mean_ttft_s']:>9.2f}s {s['p99_ttft_s']:>8.2f}s"
        )
    lines += ["", f"router counters: {report['router']['counters']}"]
    exact = report["router"]["prediction_exact_share"]
    lines.append(f"the router predicted the prefix a rank found cached exactly for {exact:.1%} of requests")
    return "\n".join(lines)
