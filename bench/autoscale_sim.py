"""The autoscaling policy measured at scale: a Mooncake-format trace replayed through a
simulated cluster, driven by the real :class:`Autoscaler` with the configuration ``tandem serve
--autoscale`` uses (``AutoscalingSpec``'s defaults; only the pools' bounds and the budget are the
bench's), against every static (prefill groups, decode groups) pair within the rank budget.

The cost model (:class:`SimModel`, every figure a field), in steps of ``dt_s``:

- **routing**: each request goes, on arrival, to the ready prefill group where it would finish
  first: that group's queue plus the prompt's cost given the prefix the group holds (the
  router's cache affinity weighed against load). Each prefill group keeps an LRU of 512-token
  blocks (``prefill_cache_tokens``); a prompt's longest cached prefix of whole blocks is not
  computed again, and its blocks enter the group's cache.
- **prefill**: a group computes one prompt at a time, in arrival order; ``new`` tokens after
  ``cached`` ones take ``new / prefill_tokens_per_s + attention_s_per_token_pair * new *
  (cached + new / 2)`` (the linear layers, and attention over the context); the KV reaches the
  decode pool ``transfer_base_s`` plus its bytes over ``transfer_bytes_per_s`` later.
- **decode**: a request whose KV has arrived joins the ready decode group with the fewest
  sequences that has a slot (``decode_max_seqs``) and KV room for its prompt and output
  (``decode_kv_tokens``), or waits in arrival order (its reservation wait); its first token
  is out when it joins. A group of ``n`` sequences holding ``K`` tokens of context makes a
  token for each every ``itl_base_s + itl_per_seq_s * n + itl_per_kv_token_s * K`` seconds.
- **groups**: one added serves ``startup_s`` after the decision (the groups of one decision
  start together) and holds its ranks from the decision on; a drained group takes no new work
  and stops when its last prompt or sequence is done.

A request meets its SLO when its TTFT and its mean inter-token latency are both within the
configuration's SLOs. Rank-seconds are the ranks held (starting, serving, draining), summed
over time. The signals the policy reads are those ``PrometheusSource`` reads, over a window of
``window_s``: TTFT and ITL p90s, mean prefill queue time and reservation wait, new prompt tokens
computed per second, and routed per second with their peak over ``BURST_WINDOW_S``, busy prefill
groups, tokens queued, mean new tokens per prompt, decode sequences in flight (waiting ones
too), their mean context, and the fullest decode group's use.

Left out: chunked or batched prefill (one prompt at a time per group), a store tier shared by
the pools, preemption, and failures; a group's start time is a constant.

``retime`` warps a trace's time so its rate swings by ``swing`` between trough and peak while
keeping its own bursts.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from tandem.autoscaler.config import AutoscalingConfig
from tandem.autoscaler.policy import Autoscaler
from tandem.autoscaler.signals import BURST_WINDOW_S, PoolSignals
from tandem.bench.hindsight import HINDSIGHT_BIN_S, hindsight_schedule, met_by_bin
from tandem.bench.router_bench import BLOCK_TOKENS, TraceRequest
from tandem.cluster.topology import AutoscalingSpec, PoolBounds
from tandem.wire.messages import Role


@dataclass(frozen=True, kw_only=True)
class SimModel:
    prefill_ranks: int = 4
    decode_ranks: int = 2
    prefill_tokens_per_s: float = 40_000.0  # one prefill group, the linear layers' part
    attention_s_per_token_pair: float = 1e-9
    prefill_cache_tokens: int = 2_000_000  # per prefill group
    decode_max_seqs: int = 64
    decode_kv_tokens: int = 1_000_000  # per decode group
    itl_base_s: float = 0.012
    itl_per_seq_s: float = 0.0003
    itl_per_kv_token_s: float = 2e-8
    kv_bytes_per_token: float = 70_272.0  # DeepSeek-V3's MLA: 61 layers x 576 values x 2 bytes
    transfer_bytes_per_s: float = 50e9
    transfer_base_s: float = 0.005
    startup_s: float = 60.0
    dt_s: float = 0.25

    def prefill_s(self, new: int, cached: int) -> float:
        return new / self.prefill_tokens_per_s + self.attention_s_per_token_pair * new * (cached + new / 2)

    def transfer_s(self, tokens: int) -> float:
        return self.transfer_base_s + tokens * self.kv_bytes_per_token / self.transfer_bytes_per_s

    def itl_s(self, seqs: int, kv_tokens: float) -> float:
        return self.itl_base_s + self.itl_per_seq_s * seqs + self.itl_per_kv_token_s * kv_tokens


def bench_config(
    model: SimModel | None = None,
    rank_budget: int = 48,
    max_groups: int = 8,
    ttft_slo_s: float | None = None,
    itl_slo_s: float | None = None,
) -> AutoscalingConfig:
    """``tandem serve --autoscale``'s configuration for the simulated pools: ``AutoscalingSpec``'s
    defaults but for the pools' bounds, the budget and (when given) the SLOs."""
    model = model or SimModel()
    slos = {"ttft_slo_s": ttft_slo_s, "itl_slo_s": itl_slo_s}
    spec = AutoscalingSpec(
        prefill=PoolBounds(min_groups=1, max_groups=max_groups),
        decode=PoolBounds(min_groups=1, max_groups=max_groups),
        rank_budget=rank_budget,
        **{k: v for k, v in slos.items() if v is not None},
    )
    return spec.config(model.prefill_ranks, model.decode_ranks)


def retime(requests: list[TraceRequest], swing: float, cycles: float = 2.0) -> list[float]:
    """New arrival times over the trace's span at a rate multiplied by ``1 - a cos(2 pi cycles
    t / span)``, with ``(1 + a) / (1 - a) = swing``: time is warped so the trace's own pattern
    (its bursts, or its flat rate) is kept and modulated from a trough to ``cycles`` peaks and
    back. Arrivals keep their order."""
    span = max(r.arrival_s for r in requests) or 1.0
    a = (swing - 1) / (swing + 1)
    steps = 20_000
    times, cumulative = [0.0], [0.0]
    for i in range(1, steps + 1):  # the cumulative rate, integrated numerically
        t = span * i / steps
        rate = 1 - a * math.cos(2 * math.pi * cycles * t / span)
        times.append(t)
        cumulative.append(cumulative[-1] + rate * span / steps)
    total = cumulative[-1]
    out = []
    for r in requests:
        target = total * r.arrival_s / span
        j = min(bisect.bisect_left(cumulative, target), steps)
        if j == 0:
            out.append(0.0)
            continue
        low, high = cumulative[j - 1], cumulative[j]  # interpolate within the step
        share = (target - low) / (high - low) if high > low else 0.0
        out.append(times[j - 1] + share * (times[j] - times[j - 1]))
    return out


@dataclass
class _Request:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    blocks: tuple[int, ...]
    new_tokens: int = 0
    kv_ready_s: float = 0.0
    first_token_s: float | None = None
    done_s: float | None = None
    finish_progress: float = 0.0


@dataclass
class _PrefillGroup:
    ready_at_s: float
    free_at_s: float = 0.0
    draining: bool = False
    cache: OrderedDict[int, None] = field(default_factory=OrderedDict)


@dataclass
class _DecodeGroup:
    ready_at_s: float
    draining: bool = False
    progress: float = 0.0  # tokens each member made since the group began: the group's clock
    members: list[tuple[float, int, _Request]] = field(default_factory=list)  # a heap by finish
    prompt_sum: float = 0.0
    join_sum: float = 0.0  # the members' progress when they joined
    reserved: float = 0.0  # KV tokens reserved (prompt + output)

    @property
    def seqs(self) -> int:
        return len(self.members)

    def context(self) -> float:
        return self.prompt_sum + self.seqs * self.progress - self.join_sum


@dataclass
class SimResult:
    slo_attainment: float
    rank_seconds: float
    finished: int
    adds: int = 0
    drains: int = 0
    cached_share: float = 0.0  # of prompt tokens, not computed again

    def as_dict(self) -> dict[str, Any]:
        return {"slo_attainment": round(self.slo_attainment, 4), "rank_seconds": round(self.rank_seconds, 1),
                "finished": self.finished, "adds": self.adds, "drains": self.drains,
                "cached_share": round(self.cached_share, 4)}  # fmt: skip


class Simulation:
    """One run: ``prefill_groups`` and ``decode_groups`` from the start; with ``autoscale`` the
    policy of ``config`` resizes them every ``interval_s``."""

    def __init__(
        self,
        arrivals: list[float],
        requests: list[TraceRequest],
        model: SimModel,
        config: AutoscalingConfig,
        prefill_groups: int,
        decode_groups: int,
        autoscale: bool,
        window_s: float = 60.0,
    ) -> None:
        self.model, self.config, self.window_s = model, config, window_s
        self.pending = deque(
            _Request(t, r.input_length, max(r.output_length, 1), r.full_blocks)
            for t, r in sorted(zip(arrivals, requests, strict=True), key=lambda pair: pair[0])
        )
        self.total = len(self.pending)
        self.prefill = [_PrefillGroup(0.0) for _ in range(prefill_groups)]
        self.decode = [_DecodeGroup(0.0) for _ in range(decode_groups)]
        self.policy = Autoscaler(config) if autoscale else None
        self.cache_blocks = max(1, model.prefill_cache_tokens // BLOCK_TOKENS)
        self.ids = itertools.count()
        self.prefilling: list[tuple[float, int, _Request]] = []  # a heap by prefill's end
        self.in_transfer: list[tuple[float, int, _Request]] = []  # a heap by KV arrival
        self.waiting: deque[_Request] = deque()  # KV arrived, no decode slot yet
        self.done = 0
        self.met = 0
        self.outcomes: list[tuple[float, bool]] = []  # (arrival, met its SLO) per finished request
        self.prompt_total = self.cached_total = 0
        self.rank_seconds = 0.0
        self.adds = self.drains = 0
        self.timeline: list[tuple[float, int, int]] = []  # per tick: (time, serving prefill, decode)
        # prefill work by start time: (start, end, wait, new tokens), not yet started / started
        self.scheduled: list[tuple[float, int, float, float, int]] = []
        self.started: deque[tuple[float, float, float, int]] = deque()
        self.queued_tokens = 0
        # window samples
        self.ttfts: deque[tuple[float, float]] = deque()
        self.itls: deque[tuple[float, float, float]] = deque()  # (time, itl, tokens)
        self.reservation_waits: deque[tuple[float, float]] = deque()
        self.routed: deque[tuple[float, int]] = deque()  # (arrival, new prompt tokens)

    def run(self) -> SimResult:
        m, t = self.model, 0.0
        next_tick = self.config.interval_s
        horizon = (self.pending[-1].arrival_s if self.pending else 0.0) + 3600.0
        while self.done < self.total and t < horizon:
            self._arrive(t)
            self._start_prefills(t)
            self._admit(t)
            self._decode(t)
            self._retire(t)
            self._account()
            if self.policy is not None and t >= next_tick:
                self._tick(t)
                next_tick += self.config.interval_s
            t += m.dt_s
        return SimResult(
            self.met / self.total if self.total else 0.0,
            self.rank_seconds,
            self.done,
            self.adds,
            self.drains,
            self.cached_total / self.prompt_total if self.prompt_total else 0.0,
        )

    # -- the cluster's step --------------------------------------------------------------------
    def _serving(self, groups: list[Any], t: float) -> list[Any]:
        return [g for g in groups if g.ready_at_s <= t and not g.draining]

    def _arrive(self, t: float) -> None:
        m = self.model
        while self.pending and self.pending[0].arrival_s <= t:
            r = self.pending.popleft()
            best: tuple[float, int, _PrefillGroup] | None = None
            for group in self._serving(self.prefill, t):
                cached = self._cached_tokens(group, r)
                end = max(group.free_at_s, r.arrival_s) + m.prefill_s(r.prompt_tokens - cached, cached)
                if best is None or end < best[0]:
                    best = (end, cached, group)
            assert best is not None, "a prefill pool never drains its last serving group"
            end, cached, group = best
            start = max(group.free_at_s, r.arrival_s)
            group.free_at_s = end
            self._remember(group, r.blocks)
            r.new_tokens = r.prompt_tokens - cached
            self.routed.append((r.arrival_s, r.new_tokens))
            self.prompt_total += r.prompt_tokens
            self.cached_total += cached
            r.kv_ready_s = end + m.transfer_s(r.prompt_tokens)
            heapq.heappush(self.prefilling, (end, next(self.ids), r))
            heapq.heappush(self.scheduled, (start, next(self.ids), end, start - r.arrival_s, r.new_tokens))
            self.queued_tokens += r.new_tokens

    def _cached_tokens(self, group: _PrefillGroup, r: _Request) -> int:
        hit = 0
        for block in r.blocks:
            if block not in group.cache:
                break
            hit += 1
        return min(hit * BLOCK_TOKENS, r.prompt_tokens - 1)  # the last token is always computed

    def _remember(self, group: _PrefillGroup, blocks: tuple[int, ...]) -> None:
        cache = group.cache
        for block in blocks:
            cache[block] = None
            cache.move_to_end(block)
        while len(cache) > self.cache_blocks:
            cache.popitem(last=False)

    def _start_prefills(self, t: float) -> None:
        while self.scheduled and self.scheduled[0][0] <= t:
            start, _, end, wait, new = heapq.heappop(self.scheduled)
            self.started.append((start, end, wait, new))
            self.queued_tokens -= new

    def _admit(self, t: float) -> None:
        while self.prefilling and self.prefilling[0][0] <= t:
            r = heapq.heappop(self.prefilling)[2]
            heapq.heappush(self.in_transfer, (r.kv_ready_s, next(self.ids), r))
        while self.in_transfer and self.in_transfer[0][0] <= t:
            self.waiting.append(heapq.heappop(self.in_transfer)[2])
        m = self.model
        open_groups = self._serving(self.decode, t)
        while self.waiting:
            r = self.waiting[0]
            need = r.prompt_tokens + r.output_tokens
            fits = [
                g
                for g in open_groups
                if g.seqs < m.decode_max_seqs and g.reserved + need <= m.decode_kv_tokens
            ]
            if not fits:
                break
            group = min(fits, key=lambda g: g.seqs)
            self.waiting.popleft()
            r.first_token_s = t
            self.ttfts.append((t, t - r.arrival_s))
            self.reservation_waits.append((t, t - r.kv_ready_s))
            if r.output_tokens <= 1:
                self._finish(r, t)
                continue
            r.finish_progress = group.progress + r.output_tokens - 1
            heapq.heappush(group.members, (r.finish_progress, next(self.ids), r))
            group.prompt_sum += r.prompt_tokens
            group.join_sum += group.progress
            group.reserved += need

    def _decode(self, t: float) -> None:
        m = self.model
        for group in self.decode:
            if not group.members:
                continue
            itl = m.itl_s(group.seqs, group.context())
            tokens = m.dt_s / itl
            self.itls.append((t, itl, tokens * group.seqs))
            group.progress += tokens
            while group.members and group.members[0][0] <= group.progress:
                finish, _, r = heapq.heappop(group.members)
                group.prompt_sum -= r.prompt_tokens
                group.join_sum -= finish - (r.output_tokens - 1)
                group.reserved -= r.prompt_tokens + r.output_tokens
                self._finish(r, t + m.dt_s - (group.progress - finish) * itl)

    def _finish(self, r: _Request, t: float) -> None:
        assert r.first_token_s is not None
        r.done_s = max(t, r.first_token_s)
        self.done += 1
        ttft = r.first_token_s - r.arrival_s
        itl = (r.done_s - r.first_token_s) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        met = ttft <= self.config.ttft_slo_s and itl <= self.config.itl_slo_s
        self.met += met
        self.outcomes.append((r.arrival_s, met))

    def _retire(self, t: float) -> None:
        self.prefill = [g for g in self.prefill if not (g.draining and g.free_at_s <= t)]
        self.decode = [g for g in self.decode if not (g.draining and not g.members)]

    def _account(self) -> None:
        ranks = len(self.prefill) * self.model.prefill_ranks + len(self.decode) * self.model.decode_ranks
        self.rank_seconds += ranks * self.model.dt_s

    # -- the autoscaler ------------------------------------------------------------------------
    def _tick(self, t: float) -> None:
        assert self.policy is not None
        start = t - self.window_s
        for samples in (self.ttfts, self.itls, self.reservation_waits):
            while samples and samples[0][0] < start:
                samples.popleft()
        while self.routed and self.routed[0][0] < start - BURST_WINDOW_S:
            self.routed.popleft()
        while self.started and self.started[0][1] < start:
            self.started.popleft()
        signals = {Role.PREFILL: self._prefill_signals(t), Role.DECODE: self._decode_signals(t)}
        self.timeline.append((t, signals[Role.PREFILL].ready_groups, signals[Role.DECODE].ready_groups))
        for decision in self.policy.decide(signals):
            pool: list[Any] = self.prefill if decision.pool == "prefill" else self.decode
            count = decision.count
            if decision.action == "add":
                ready = t + self.model.startup_s
                pool.extend(
                    (_PrefillGroup(ready, ready) if pool is self.prefill else _DecodeGroup(ready))
                    for _ in range(count)
                )
                self.adds += count
            elif decision.action == "drain":
                serving = self._serving(pool, t)
                # the decode groups with the fewest sequences, the prefill groups added last
                order = sorted(serving, key=lambda g: g.seqs) if pool is self.decode else serving[::-1]
                for group in order[: min(count, len(serving) - 1)]:
                    group.draining = True
                    self.drains += 1

    def _prefill_signals(self, t: float) -> PoolSignals:
        w = self.window_s
        ready = len(self._serving(self.prefill, t))
        pending = len(self.prefill) - ready
        in_window = [(s, e, wait, new) for s, e, wait, new in self.started if s >= t - w]
        busy = sum(max(0.0, min(e, t) - max(s, t - w)) for s, e, _, _ in self.started) / w
        computed = sum(  # the new tokens computed within the window, pro rata
            new * max(0.0, min(e, t) - max(s, t - w)) / (e - s) if e > s else float(new)
            for s, e, _, new in self.started
        )
        return PoolSignals(
            ready_groups=ready,
            pending_groups=pending,
            latency_p90_s=_p90([v for _, v in self.ttfts]),
            queue_s=_mean([wait for _, _, wait, _ in in_window]),
            demand=computed / w,
            busy_groups=busy,
            backlog=float(self.queued_tokens),
            prompt_tokens=_mean([float(new) for _, _, _, new in in_window]),
            demand_peak=self._peak_rate(t),
            arrival_rate=self._arrival_rate(t),
        )

    def _peak_rate(self, t: float, step_s: float = 5.0) -> float | None:
        """The largest rate of new prompt tokens routed over ``BURST_WINDOW_S``, at every
        ``step_s`` within the window (PromQL's ``max_over_time(rate(...[15s])[1m:1s])``, at a
        coarser step)."""
        if not self.routed:
            return None
        ends = [t - k * step_s for k in range(int(self.window_s // step_s) + 1)]
        return (
            max(sum(new for at, new in self.routed if end - BURST_WINDOW_S < at <= end) for end in ends)
            / BURST_WINDOW_S
        )

    def _arrival_rate(self, t: float) -> float:
        """New prompt tokens routed a second over the window."""
        return sum(new for at, new in self.routed if at > t - self.window_s) / self.window_s

    def _decode_signals(self, t: float) -> PoolSignals:
        m = self.model
        ready = len(self._serving(self.decode, t))
        pending = len(self.decode) - ready
        running = sum(g.seqs for g in self.decode)
        usage = [
            max(g.seqs / m.decode_max_seqs, g.reserved / m.decode_kv_tokens)
            for g in self.decode
            if g.ready_at_s <= t
        ]
        context = sum(g.context() for g in self.decode)
        return PoolSignals(
            ready_groups=ready,
            pending_groups=pending,
            latency_p90_s=_weighted_p90([(itl, n) for _, itl, n in self.itls]),
            queue_s=_mean([v for _, v in self.reservation_waits]),
            kv_usage=max(usage) if usage else None,
            demand=float(running + len(self.in_transfer)),
            backlog=float(len(self.waiting)),
            context_tokens=context / running if running else None,
        )


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _p90(values: list[float]) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1]


def _weighted_p90(samples: list[tuple[float, float]]) -> float | None:
    total = sum(n for _, n in samples)
    if total <= 0:
        return None
    seen = 0.0
    for value, n in sorted(samples):
        seen += n
        if seen >= 0.9 * total:
            return value
    return max(samples)[0]


def run_autoscale_bench(
    requests: list[TraceRequest],
    config: AutoscalingConfig,
    model: SimModel | None = None,
    swing: float = 4.0,
    time_scale: float = 1.0,
    window_s: float = 60.0,
) -> dict[str, Any]:
    """The autoscaler from the pools' minimum against every static pair within the budget."""
    model = model or SimModel()
    arrivals = [t / time_scale for t in retime(requests, swing)]
    p0, d0 = config.prefill.min_groups, config.decode.min_groups
    scaled = Simulation(arrivals, requests, model, config, p0, d0, autoscale=True, window_s=window_s).run()
    static = []
    met_by_minute: dict[tuple[int, int], dict[int, int]] = {}
    ranks_of: dict[tuple[int, int], int] = {}
    for p in range(config.prefill.min_groups, config.prefill.max_groups + 1):
        for d in range(config.decode.min_groups, config.decode.max_groups + 1):
            ranks = p * config.prefill.ranks_per_group + d * config.decode.ranks_per_group
            if ranks > config.rank_budget:
                continue
            sim = Simulation(arrivals, requests, model, config, p, d, autoscale=False)
            result = sim.run()
            static.append({"prefill_groups": p, "decode_groups": d, **result.as_dict()})
            met_by_minute[p, d], ranks_of[p, d] = met_by_bin(sim.outcomes, HINDSIGHT_BIN_S), ranks
    auto = scaled.as_dict()

    def cheapest(at_least: float) -> dict[str, Any] | None:
        matching = [s for s in static if s["slo_attainment"] >= at_least]
        return min(matching, key=lambda s: s["rank_seconds"]) if matching else None

    at_attainment = cheapest(scaled.slo_attainment)
    affordable = [s for s in static if s["rank_seconds"] <= scaled.rank_seconds]
    best_same_cost = max(affordable, key=lambda s: s["slo_attainment"]) if affordable else None
    return {
        "requests": len(requests),
        "rate_swing": swing,
        "time_scale": time_scale,
        "autoscaler": auto,
        "static": static,
        "cheapest_static_at_autoscaler_attainment": at_attainment,
        "rank_seconds_ratio": (
            round(scaled.rank_seconds / at_attainment["rank_seconds"], 4) if at_attainment else None
        ),
        "best_static_at_autoscaler_rank_seconds": best_same_cost,
        "cheapest_static_at_0.99": cheapest(0.99),
        "hindsight_at_autoscaler_attainment": hindsight_schedule(
            met_by_minute, ranks_of, scaled.slo_attainment, len(requests), HINDSIGHT_BIN_S
        ),
    }


# The generated traces' rates for this bench: each keeps its shape's 30 minutes and is dense
# enough that its peak needs most of the default budget.
BENCH_SHAPES: dict[str, dict[str, float]] = {
    "long-prompt": {"sessions_per_s": 3.0},
    "bursty-short": {"requests_per_s": 12.0},
}


def generated_trace(shape: str, seed: int = 0) -> list[TraceRequest]:
    """One of ``trace_gen``'s shapes at the bench's rate, as requests."""
    from tandem.bench import trace_gen

    options = {"seed": seed, **BENCH_SHAPES[shape]}
    records = (
        trace_gen.long_prompt_trace(trace_gen.LongPromptShape(**options))  # type: ignore[arg-type]
        if shape == "long-prompt"
        else trace_gen.bursty_short_trace(trace_gen.BurstyShortShape(**options))  # type: ignore[arg-type]
    )
    return [
        TraceRequest(r["timestamp"] / 1000.0, r["input_length"], r["output_length"], tuple(r["hash_ids"]))
        for r in records
    ]
