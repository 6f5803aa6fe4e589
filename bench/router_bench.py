"""Replay a Mooncake trace through the real ``Router`` over simulated prefill ranks.

Each simulated prefill rank has KV tiers (``bench/tier_cache.py``): a device LRU of
``capacity_blocks`` blocks of 512 tokens (the trace's block size, used as the page size), with
``--host-capacity-blocks N`` a host LRU of N blocks below it that takes the device's evictions,
and with ``--store`` one store all ranks share (``--store-capacity-blocks``, default unbounded)
that every rank writes the blocks it computes to. Every change is the ``KVEvent`` a real rank
sends, fed to the router with ``apply_events``: the router's index is what real ranks would
send, and the router is told each rank's tier prices (``set_tier_costs``). A rank serves its
queue first come first served. Its tiers are matched when the request starts (the rank's own
rule: leading blocks each in its device, its host or the store, up to the first in none, at
most ``(prompt - 1) // 512``); it loads a tier's blocks only if that is faster than computing
them (else it computes them, counted as recomputed), and its service time is the uncached
tokens at ``prefill_tokens_per_s`` plus the loaded ones at the tier's load speed. The request's
full blocks are stored on its device when its prefill completes (host hits move back), which
is also when the router hears ``prefill_done``. Decode ranks have ample room; a request
finishes after ``output_length`` steps of ``DECODE_STEP_S``.

With tiers, the same policy runs on each setup side by side in one report: device only,
device + host, device + host + store. The ``round_robin`` policy runs on the fullest setup
(same tiers, same service), and two cache bounds are computed without ranks: the oracle, one
infinite cache shared by everyone (36.6% of the blocks on the conversation trace), and one LRU
cache shared by everyone with the ranks' total capacity (what any routing over caches of that
total size can hope for).

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
* ``host_load_tokens_per_s`` = 25 GB/s / 70,272 bytes = 355,760 (pinned host memory over PCIe
  Gen5 or NVLink-C2C) and ``store_load_tokens_per_s`` = 5 GB/s / 70,272 = 71,152 (RDMA, the
  slow end of 5-10 GB/s): ``router.policy``'s prices, 0.017 and 0.084 of a token's compute.

Finite caches bound what any routing can reach against the infinite oracle: one LRU shared by
all 8 ranks at 1,600 blocks each hits 0.245 (0.67 of the oracle's 0.366). Measured with
``tandem bench router --trace ../shared/traces/mooncake-conversation.jsonl --prefill-ranks 8
--host-capacity-blocks 6400 --store`` (the policy's defaults, not tuned for tiers):

    setup               hit   /oracle  in-flight max/mean  computed max/mean  TTFT p50  p90
    device              0.237  0.649        1.082              1.003           1.47s   5.41s
    device+host         0.356  0.973        1.090              1.003           1.02s   4.63s
    device+host+store   0.366  1.000        1.142              1.013           0.85s   3.85s
    round-robin (all)   0.366  0.999        1.083              1.055           1.56s   9.86s

On the generated long-prompt trace (``tandem bench trace --shape long-prompt``, seed 0:
5,882 requests, prompts of 15.4k tokens on average, oracle 0.795) the same command gives
0.755 / 0.794 / 0.794 (0.950 / 0.999 / 0.999 of the oracle), in-flight max/mean 1.091 / 1.094 /
1.173, TTFT p90 2.27 / 1.83 / 1.57 s; round-robin 0.795, 1.67 s.

Hit rates count blocks as the trace does: each request's ``hash_ids``, its last partial block
included, against the blocks used from any tier when its prefill starts (``hits_by_tier``
splits them; they add up). Load balance is reported two ways, each as max/mean over the ranks:
the router's in-flight tokens averaged over time (its work in compute tokens: new tokens and
loads at their price), and the tokens each rank computed. TTFT here is arrival to prefill done
(queue, loads and compute, no transfer).
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

from tandem.bench.tier_cache import (
    BLOCK_TOKENS,
    DEFAULT_HOST_LOAD_TOKENS_PER_S,
    DEFAULT_STORE_LOAD_TOKENS_PER_S,
    RankTiers,
    SharedStore,
    TierSpeeds,
)
from tandem.router.index import TierMatch
from tandem.router.policy import PolicyConfig
from tandem.router.registry import DEFAULT_POLICY, PREFILL_POLICIES, UnknownPolicy
from tandem.router.router import Router, RouterConfig

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


@dataclass(frozen=True)
class TierSetup:
    """The simulated ranks' tiers: a device LRU each, a host LRU each (0: none), a shared store."""

    capacity_blocks: int = DEFAULT_CAPACITY_BLOCKS
    host_capacity_blocks: int = 0
    store: bool = False
    store_capacity_blocks: int | None = None  # None: unbounded

    @property
    def name(self) -> str:
        return "device" + ("+host" if self.host_capacity_blocks else "") + ("+store" if self.store else "")


@dataclass
class _Rank:
    tiers: RankTiers
    queue: deque[tuple[str, TraceRequest, float]] = field(default_factory=deque)
    busy: bool = False
    computed_tokens: int = 0
    load_area: float = 0.0  # integral of the router's in-flight tokens over time


@dataclass(frozen=True)
class SimResult:
    policy: str
    tiers: str
    hit_rate: float
    hits_by_tier: dict[str, float]  # blocks used from each tier over all blocks; they add up to hit_rate
    recomputed_rate: float  # blocks found in a tier the rank chose to compute again, over all blocks
    token_hit_rate: float
    time_avg_load_max_over_mean: float
    computed_tokens_max_over_mean: float
    utilisation: float  # computed tokens over what the ranks could compute while requests arrive
    mean_ttft_s: float
    p50_ttft_s: float
    p90_ttft_s: float
    p99_ttft_s: float
    prediction_exact_share: float  # requests whose predicted cached blocks were found at start
    counters: dict[str, int]


def simulate(
    trace: Sequence[TraceRequest],
    num_prefill_ranks: int,
    capacity_blocks: int,
    prefill_tokens_per_s: float,
    policy: str,
    policy_config: PolicyConfig | None = None,
    setup: TierSetup | None = None,
    speeds: TierSpeeds | None = None,
) -> SimResult:
    """Replay ``trace``; ``setup`` (default: devices of ``capacity_blocks`` only) names the tiers
    and ``speeds`` (default: ``prefill_tokens_per_s`` and the default load speeds) their prices."""
    setup = setup or TierSetup(capacity_blocks)
    speeds = speeds or TierSpeeds(prefill_tokens_per_s)
    router = Router(RouterConfig(policy=policy, policy_config=policy_config or PolicyConfig()))
    replay = _Replay(router, num_prefill_ranks, setup, speeds)
    replay.run(trace)
    return replay.result(trace, policy, setup.name)


class _Replay:
    """The trace's requests routed as they arrive and served by the simulated prefill ranks,
    one request at a time each (its queue behind), then decoded for ``output_length`` steps."""

    def __init__(self, router: Router, num_ranks: int, setup: TierSetup, speeds: TierSpeeds) -> None:
        self.router, self.speeds = router, speeds
        names = [f"prefill0-r{i}" for i in range(num_ranks)]
        router.set_ranks(names, [f"decode0-r{i}" for i in range(_DECODE_RANKS)])
        for rank in router.decode_ranks:
            router.update_decode_stats(rank, _DECODE_PAGES, 0, _DECODE_PAGES)
        for name in names:  # what a rank's stats would tell the frontend
            router.set_tier_costs(name, host=speeds.cost("host"), store=speeds.cost("store"))
        store = SharedStore(setup.store_capacity_blocks) if setup.store else None
        self.ranks = {
            name: _Rank(RankTiers(setup.capacity_blocks, setup.host_capacity_blocks, store)) for name in names
        }
        self.load_host, self.load_store = speeds.loads("host"), speeds.loads("store")
        self.timers: list[tuple[float, int, str, str, str]] = []  # (time, seq, kind, request id, rank)
        self.started: dict[str, tuple[TraceRequest, float, int]] = {}  # id -> request, arrival, blocks used
        self.predicted: dict[str, int] = {}
        self.ttfts: list[float] = []
        self.totals = dict.fromkeys(
            ["blocks", "tokens", "hit_tokens", "exact", "device", "host", "store", "recomputed"], 0
        )
        self.clock = 0.0
        self.seq = 0

    def run(self, trace: Sequence[TraceRequest]) -> None:
        router = self.router
        for number, request in enumerate(trace):
            while self.timers and self.timers[0][0] <= request.arrival_s:
                self._fire(*self._pop())
            self._advance(request.arrival_s)
            request_id = f"req{number}"
            decision = router.route(
                request_id, request.full_blocks, request.input_length, BLOCK_TOKENS, request.output_length
            )
            self.predicted[request_id] = decision.matched_blocks
            self.ranks[decision.prefill_rank].queue.append((request_id, request, request.arrival_s))
            self._start_next(decision.prefill_rank, request.arrival_s)
        while self.timers:
            self._fire(*self._pop())
        router.check_integrity()
        if router.num_in_flight:
            raise AssertionError(f"{router.num_in_flight} requests still in flight after the replay")

    def _pop(self) -> tuple[float, str, str, str]:
        when, _, kind, request_id, name = heapq.heappop(self.timers)
        return when, kind, request_id, name

    def _push(self, when: float, kind: str, request_id: str, name: str) -> None:
        self.seq += 1
        heapq.heappush(self.timers, (when, self.seq, kind, request_id, name))

    def _advance(self, now: float) -> None:
        if now > self.clock:
            for name, load in self.router.loads().prefill_tokens.items():
                self.ranks[name].load_area += load * (now - self.clock)
            self.clock = now

    def _start_next(self, name: str, now: float) -> None:
        rank, totals = self.ranks[name], self.totals
        if rank.busy or not rank.queue:
            return
        request_id, request, arrival = rank.queue.popleft()
        found = rank.tiers.match(request.full_blocks[: request.max_reusable_blocks])
        totals["exact"] += self.predicted.pop(request_id) == found.blocks
        # The rank's rule: the blocks of a tier slower than computing are computed again (their
        # KV is the same, so the blocks after them are still used), as the router's price says.
        used = TierMatch(
            found.device, found.host if self.load_host else 0, found.store if self.load_store else 0
        )
        new_tokens = request.input_length - used.blocks * BLOCK_TOKENS
        for tier in ("device", "host", "store"):
            totals[tier] += getattr(used, tier)
        totals["recomputed"] += found.blocks - used.blocks
        rank.busy, rank.computed_tokens = True, rank.computed_tokens + new_tokens
        self.started[request_id] = (request, arrival, used.blocks)
        self._push(now + self.speeds.service_s(new_tokens, used), "prefill", request_id, name)

    def _fire(self, now: float, kind: str, request_id: str, name: str) -> None:
        self._advance(now)
        if kind == "decode":
            self.router.finished(request_id)
            return
        request, arrival, used = self.started.pop(request_id)
        self.router.apply_events(name, self.ranks[name].tiers.complete(request.full_blocks, used))
        self.router.prefill_done(request_id)
        self.ttfts.append(now - arrival)
        self.totals["blocks"] += len(request.hash_ids)
        self.totals["tokens"] += request.input_length
        self.totals["hit_tokens"] += used * BLOCK_TOKENS
        self.ranks[name].busy = False
        self._push(now + request.output_length * DECODE_STEP_S, "decode", request_id, "")
        self._start_next(name, now)

    def result(self, trace: Sequence[TraceRequest], policy: str, tiers: str) -> SimResult:
        totals, ttfts = self.totals, sorted(self.ttfts)
        duration = max(self.clock, 1e-9)
        areas = [rank.load_area / duration for rank in self.ranks.values()]
        computed = [rank.computed_tokens for rank in self.ranks.values()]
        blocks = totals["blocks"]
        by_tier = {tier: totals[tier] / blocks for tier in ("device", "host", "store")}
        capacity = self.speeds.prefill_tokens_per_s * len(self.ranks) * max(trace[-1].arrival_s, 1e-9)
        return SimResult(
            policy=policy,
            tiers=tiers,
            hit_rate=sum(totals[tier] for tier in by_tier) / blocks,
            hits_by_tier=by_tier,
            recomputed_rate=totals["recomputed"] / blocks,
            token_hit_rate=totals["hit_tokens"] / totals["tokens"],
            time_avg_load_max_over_mean=_max_over_mean(areas),
            computed_tokens_max_over_mean=_max_over_mean(computed),
            utilisation=sum(computed) / capacity,
            mean_ttft_s=statistics.fmean(ttfts),
            p50_ttft_s=_percentile(ttfts, 0.50),
            p90_ttft_s=_percentile(ttfts, 0.90),
            p99_ttft_s=_percentile(ttfts, 0.99),
            prediction_exact_share=totals["exact"] / len(trace),
            counters=self.router.counters(),
        )


def _percentile(ordered: Sequence[float], share: float) -> float:
    return ordered[min(len(ordered) - 1, max(0, math.ceil(share * len(ordered)) - 1))]


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
    host_capacity_blocks: int = 0,
    store: bool = False,
    store_capacity_blocks: int | None = None,
    host_load_tokens_per_s: float = DEFAULT_HOST_LOAD_TOKENS_PER_S,
    store_load_tokens_per_s: float = DEFAULT_STORE_LOAD_TOKENS_PER_S,
) -> dict[str, Any]:
    """Replay ``trace_path`` with ``policy`` and with round-robin; the report as a dict.

    With a host tier or a store, ``policy`` runs once per tier setup, side by side (device
    only, then with the host tier, then with the store too: ``report["tiers"]``), and
    round-robin and the top-level ``router`` figures are the fullest setup's."""
    _check_args(prefill_ranks, capacity_blocks, host_capacity_blocks, store, store_capacity_blocks, policy)
    speeds = TierSpeeds(prefill_tokens_per_s, host_load_tokens_per_s, store_load_tokens_per_s)
    setups = [TierSetup(capacity_blocks)]
    if host_capacity_blocks:
        setups.append(TierSetup(capacity_blocks, host_capacity_blocks))
    if store:
        setups.append(TierSetup(capacity_blocks, host_capacity_blocks, True, store_capacity_blocks))
    trace = read_trace(trace_path)
    oracle = shared_cache_hit_rate(trace, None)
    tiers: dict[str, dict[str, Any]] = {}
    for setup in setups:
        result = simulate(
            trace, prefill_ranks, capacity_blocks, prefill_tokens_per_s, policy, None, setup, speeds
        )
        bound = _shared_bound(trace, setup, prefill_ranks, oracle)
        tiers[setup.name] = {
            **_summary(result),
            "router_over_oracle": result.hit_rate / oracle if oracle else 0.0,
            "shared_lru_same_capacity": bound,
            "router_over_shared_lru": result.hit_rate / bound if bound else 0.0,
        }
    fullest = setups[-1]
    routed = tiers[fullest.name]
    baseline = simulate(
        trace, prefill_ranks, capacity_blocks, prefill_tokens_per_s, "round_robin", None, fullest, speeds
    )
    report: dict[str, Any] = {
        "parameters": {
            "trace": str(trace_path),
            "requests": len(trace),
            "prefill_ranks": prefill_ranks,
            "capacity_blocks": capacity_blocks,
            "host_capacity_blocks": host_capacity_blocks,
            "store": store,
            "store_capacity_blocks": store_capacity_blocks,
            "block_tokens": BLOCK_TOKENS,
            "prefill_tokens_per_s": prefill_tokens_per_s,
            "host_load_tokens_per_s": host_load_tokens_per_s,
            "store_load_tokens_per_s": store_load_tokens_per_s,
            "policy": policy,
            "tiers": fullest.name,
        },
        "hit_rate": {
            "router": routed["hit_rate"],
            "round_robin": baseline.hit_rate,
            "oracle": oracle,
            "shared_lru_same_capacity": routed["shared_lru_same_capacity"],
            "router_over_oracle": routed["router_over_oracle"],
            "router_over_shared_lru": routed["router_over_shared_lru"],
        },
        "router": routed,
        "round_robin": _summary(baseline),
    }
    if len(setups) > 1:
        report["tiers"] = tiers
    return report


def _check_args(
    prefill_ranks: int,
    capacity_blocks: int,
    host_capacity_blocks: int,
    store: bool,
    store_capacity_blocks: int | None,
    policy: str,
) -> None:
    if prefill_ranks < 1:
        raise ValueError(f"--prefill-ranks must be at least 1, got {prefill_ranks}")
    if capacity_blocks < 1:
        raise ValueError(f"--capacity-blocks must be at least 1, got {capacity_blocks}")
    if host_capacity_blocks < 0:
        raise ValueError(f"--host-capacity-blocks must be >= 0, got {host_capacity_blocks}")
    if store_capacity_blocks is not None and not store:
        raise ValueError("--store-capacity-blocks needs --store")
    if store_capacity_blocks is not None and store_capacity_blocks < 1:
        raise ValueError(f"--store-capacity-blocks must be at least 1, got {store_capacity_blocks}")
    if policy not in PREFILL_POLICIES:
        raise UnknownPolicy(policy)


def _shared_bound(trace: Sequence[TraceRequest], setup: TierSetup, ranks: int, oracle: float) -> float:
    """One LRU shared by everyone with all of ``setup``'s capacity (an unbounded store: the oracle)."""
    if setup.store and setup.store_capacity_blocks is None:
        return oracle
    total = ranks * (setup.capacity_blocks + setup.host_capacity_blocks) + (setup.store_capacity_blocks or 0)
    return shared_cache_hit_rate(trace, total)


def _summary(result: SimResult) -> dict[str, Any]:
    return {
        "tiers": result.tiers,
        "hit_rate": result.hit_rate,
        "hits_by_tier": result.hits_by_tier,
        "recomputed_rate": result.recomputed_rate,
        "token_hit_rate": result.token_hit_rate,
        "time_avg_in_flight_tokens_max_over_mean": result.time_avg_load_max_over_mean,
        "computed_tokens_max_over_mean": result.computed_tokens_max_over_mean,
        "utilisation": result.utilisation,
        "mean_ttft_s": result.mean_ttft_s,
        "p50_ttft_s": result.p50_ttft_s,
        "p90_ttft_s": result.p90_ttft_s,
        "p99_ttft_s": result.p99_ttft_s,
        "prediction_exact_share": result.prediction_exact_share,
        "counters": result.counters,
    }


def format_report(report: dict[str, Any]) -> str:
    params, hits = report["parameters"], report["hit_rate"]
    tiers = ""
    if params["host_capacity_blocks"]:
        tiers += f", host {params['host_capacity_blocks']} blocks each"
    if params["store"]:
        size = params["store_capacity_blocks"]
        tiers += f", a shared store of {size if size else 'unbounded'} blocks"
    lines = [
        f"trace {params['trace']}: {params['requests']} requests, {params['prefill_ranks']} prefill ranks, "
        f"{params['capacity_blocks']} device blocks of {params['block_tokens']} tokens each{tiers}, "
        f"{params['prefill_tokens_per_s']:.0f} tokens/s each, policy {params['policy']}",
    ]
    if params["host_capacity_blocks"] or params["store"]:
        lines.append(
            f"loads: host {params['host_load_tokens_per_s']:,.0f} tokens/s, "
            f"store {params['store_load_tokens_per_s']:,.0f} tokens/s"
        )
    lines += [
        f"block hit rate: router {hits['router']:.4f}  round-robin {hits['round_robin']:.4f}  "
        f"oracle {hits['oracle']:.4f}  one shared LRU of the ranks' total size "
        f"{hits['shared_lru_same_capacity']:.4f}",
        f"router / oracle {hits['router_over_oracle']:.3f}  "
        f"router / shared LRU {hits['router_over_shared_lru']:.3f}",
        "",
        f"{'':18} {'hit':>6} {'/oracle':>7} {'device':>7} {'host':>6} {'store':>6} {'recomp':>6} "
        f"{'in-flight':>9} {'computed':>8} {'busy':>6} {'TTFT p50':>8} {'p90':>7} {'p99':>7}",
    ]
    rows = [(name, summary) for name, summary in report.get("tiers", {"router": report["router"]}).items()]
    rows.append(("round_robin", report["round_robin"]))
    for name, s in rows:
        by_tier, oracle = s["hits_by_tier"], hits["oracle"]
        lines.append(
            f"{name:18} {s['hit_rate']:>6.3f} {s['hit_rate'] / oracle if oracle else 0.0:>7.3f} "
            f"{by_tier['device']:>7.3f} {by_tier['host']:>6.3f} {by_tier['store']:>6.3f} "
            f"{s['recomputed_rate']:>6.3f} {s['time_avg_in_flight_tokens_max_over_mean']:>9.3f} "
            f"{s['computed_tokens_max_over_mean']:>8.3f} {s['utilisation']:>6.1%} "
            f"{s['p50_ttft_s']:>7.2f}s {s['p90_ttft_s']:>6.2f}s {s['p99_ttft_s']:>6.2f}s"
        )
    lines.append(
        "(hit rates are shares of all blocks; in-flight and computed are max/mean over the ranks; "
        f"round-robin runs with {params['tiers']})"
    )
    lines += ["", f"router counters: {report['router']['counters']}"]
    exact = report["router"]["prediction_exact_share"]
    lines.append(f"the router predicted the prefix a rank found cached exactly for {exact:.1%} of requests")
    return "\n".join(lines)
