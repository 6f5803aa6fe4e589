"""The autoscaling policy measured at scale: a Mooncake-format trace replayed through a
simulated cluster, driven by the real :class:`Autoscaler`, against every static (prefill groups,
decode groups) pair within the rank budget.

The simulated cluster, in steps of ``dt_s``:

- prefill: one FIFO queue served by the ready prefill groups together, each computing
  ``prefill_tokens_per_s`` new prompt tokens a second; a prompt's first token exists when its
  last token is computed (plus ``transfer_s``);
- decode: a request joins the ready decode group with the fewest sequences below
  ``decode_max_seqs`` (or waits: its reservation wait); a group's batch of n sequences makes a
  token each ``itl_base_s + itl_per_seq_s * n`` seconds;
- a group added starts ``startup_s`` later (its ranks count from the decision); a drained
  decode group takes no new sequence and stops when its last one ends.

A request meets its SLO when its TTFT and its mean inter-token latency are both within the
configuration's SLOs; rank-seconds are the ranks held, summed over time. ``retime`` gives the
trace's (nearly flat) arrivals a rate that swings by ``swing`` between trough and peak.
"""

from __future__ import annotations

import bisect
import math
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from tandem.autoscaler.config import AutoscalingConfig, PoolLimits
from tandem.autoscaler.policy import Autoscaler
from tandem.autoscaler.signals import PoolSignals
from tandem.bench.router_bench import TraceRequest
from tandem.wire.messages import Role


@dataclass(frozen=True, kw_only=True)
class SimModel:
    prefill_tokens_per_s: float = 20_000.0  # one prefill group (the default: 4 ranks)
    decode_max_seqs: int = 48
    itl_base_s: float = 0.015
    itl_per_seq_s: float = 0.0008
    startup_s: float = 60.0
    transfer_s: float = 0.02
    dt_s: float = 0.25


def retime(requests: list[TraceRequest], swing: float, cycles: float = 2.0) -> list[float]:
    """New arrival times over the trace's span, in its order, at a rate
    ``mean * (1 - a cos(2 pi cycles t / span))`` with ``(1 + a) / (1 - a) = swing``: from a
    trough to ``cycles`` peaks and back."""
    span = max(r.arrival_s for r in requests) or 1.0
    a = (swing - 1) / (swing + 1)
    n = len(requests)
    steps = 20_000
    times, cumulative = [0.0], [0.0]
    for i in range(1, steps + 1):  # the cumulative rate, integrated numerically
        t = span * i / steps
        rate = 1 - a * math.cos(2 * math.pi * cycles * t / span)
        times.append(t)
        cumulative.append(cumulative[-1] + rate * span / steps)
    total = cumulative[-1]
    out = []
    for k in range(n):
        target = total * k / n
        j = bisect.bisect_left(cumulative, target)
        out.append(times[min(j, steps)])
    return out


@dataclass
class _Request:
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    left_to_prefill: float = 0.0
    prefill_start_s: float | None = None
    kv_ready_s: float | None = None
    first_token_s: float | None = None
    generated: float = 0.0
    itl_weighted_s: float = 0.0  # sum of (ITL * tokens) while decoding
    done_s: float | None = None


@dataclass
class _Group:
    ready_at_s: float
    draining: bool = False
    seqs: list[_Request] = field(default_factory=list)


@dataclass
class SimResult:
    slo_attainment: float
    rank_seconds: float
    finished: int
    adds: int = 0
    drains: int = 0

    def as_dict(self) -> dict[str, Any]:
        return {"slo_attainment": round(self.slo_attainment, 4), "rank_seconds": round(self.rank_seconds, 1),
                "finished": self.finished, "adds": self.adds, "drains": self.drains}  # fmt: skip


class Simulation:
    """One run: static groups when ``config`` is ``None``, else the autoscaler from these."""

    def __init__(
        self,
        arrivals: list[float],
        requests: list[TraceRequest],
        model: SimModel,
        slo: AutoscalingConfig,
        prefill_groups: int,
        decode_groups: int,
        autoscale: bool,
        window_s: float = 60.0,
    ) -> None:
        self.model, self.slo, self.window_s = model, slo, window_s
        self.pending = deque(
            _Request(t, r.input_length, max(r.output_length, 1))
            for t, r in zip(arrivals, requests, strict=True)
        )
        self.prefill = [_Group(0.0) for _ in range(prefill_groups)]
        self.decode = [_Group(0.0) for _ in range(decode_groups)]
        self.policy = Autoscaler(slo) if autoscale else None
        self.queue: deque[_Request] = deque()  # waiting for, or in, prefill
        self.waiting: deque[_Request] = deque()  # KV ready, waiting for a decode slot
        self.done: list[_Request] = []
        self.rank_seconds = 0.0
        self.adds = self.drains = 0
        # window samples: (time, value)
        self.ttfts: deque[tuple[float, float]] = deque()
        self.itls: deque[tuple[float, float, float]] = deque()  # (time, itl, tokens)
        self.prefill_waits: deque[tuple[float, float]] = deque()
        self.reservation_waits: deque[tuple[float, float]] = deque()
        self.arrived_tokens: deque[tuple[float, float]] = deque()

    def run(self) -> SimResult:
        m, t, total = self.model, 0.0, len(self.pending)
        next_tick = self.slo.interval_s
        horizon = (self.pending[-1].arrival_s if self.pending else 0.0) + 3600.0
        while len(self.done) < total and t < horizon:
            self._arrive(t)
            self._prefill(t)
            self._admit(t)
            self._decode(t)
            self._account()
            if self.policy is not None and t >= next_tick:
                self._tick(t)
                next_tick += self.slo.interval_s
            t += m.dt_s
        met = sum(1 for r in self.done if self._meets(r))
        return SimResult(
            met / total if total else 0.0, self.rank_seconds, len(self.done), self.adds, self.drains
        )

    def _meets(self, r: _Request) -> bool:
        assert r.first_token_s is not None
        ttft = r.first_token_s - r.arrival_s
        itl = r.itl_weighted_s / r.generated if r.generated > 1 else 0.0
        return ttft <= self.slo.ttft_slo_s and itl <= self.slo.itl_slo_s

    # -- the cluster's step --------------------------------------------------------------------
    def _arrive(self, t: float) -> None:
        while self.pending and self.pending[0].arrival_s <= t:
            r = self.pending.popleft()
            r.left_to_prefill = r.prompt_tokens
            self.queue.append(r)
            self.arrived_tokens.append((t, r.prompt_tokens))

    def _prefill(self, t: float) -> None:
        ready = sum(1 for g in self.prefill if g.ready_at_s <= t and not g.draining)
        budget = ready * self.model.prefill_tokens_per_s * self.model.dt_s
        while self.queue and budget > 0:
            r = self.queue[0]
            if r.prefill_start_s is None:
                r.prefill_start_s = t
                self.prefill_waits.append((t, t - r.arrival_s))
            used = min(budget, r.left_to_prefill)
            r.left_to_prefill -= used
            budget -= used
            if r.left_to_prefill <= 0:
                self.queue.popleft()
                r.kv_ready_s = t + self.model.transfer_s
                self.waiting.append(r)

    def _admit(self, t: float) -> None:
        open_groups = [g for g in self.decode if g.ready_at_s <= t and not g.draining]
        while self.waiting and open_groups:
            r = self.waiting[0]
            assert r.kv_ready_s is not None
            if r.kv_ready_s > t:
                break
            group = min(open_groups, key=lambda g: len(g.seqs))
            if len(group.seqs) >= self.model.decode_max_seqs:
                break
            self.waiting.popleft()
            group.seqs.append(r)
            r.first_token_s = t
            r.generated = 1.0
            self.ttfts.append((t, t - r.arrival_s))
            self.reservation_waits.append((t, t - r.kv_ready_s))

    def _decode(self, t: float) -> None:
        m = self.model
        for group in self.decode:
            if not group.seqs:
                continue
            itl = m.itl_base_s + m.itl_per_seq_s * len(group.seqs)
            tokens = m.dt_s / itl
            self.itls.append((t, itl, tokens * len(group.seqs)))
            still = []
            for r in group.seqs:
                step = min(tokens, r.output_tokens - r.generated)
                r.generated += step
                r.itl_weighted_s += itl * step
                if r.generated >= r.output_tokens:
                    r.done_s = t
                    self.done.append(r)
                else:
                    still.append(r)
            group.seqs = still
        self.decode = [g for g in self.decode if not (g.draining and not g.seqs)]

    def _account(self) -> None:
        ranks = (
            len(self.prefill) * self.slo.prefill.ranks_per_group
            + len(self.decode) * self.slo.decode.ranks_per_group
        )
        self.rank_seconds += ranks * self.model.dt_s

    # -- the autoscaler ------------------------------------------------------------------------
    def _tick(self, t: float) -> None:
        assert self.policy is not None
        start = t - self.window_s
        for samples in (
            self.ttfts,
            self.itls,
            self.prefill_waits,
            self.reservation_waits,
            self.arrived_tokens,
        ):
            while samples and samples[0][0] < start:
                samples.popleft()
        signals = {Role.PREFILL: self._signals(self.prefill, t, Role.PREFILL),
                   Role.DECODE: self._signals(self.decode, t, Role.DECODE)}  # fmt: skip
        for decision in self.policy.decide(signals):
            pool = self.prefill if decision.pool == "prefill" else self.decode
            if decision.action == "add":
                pool.append(_Group(t + self.model.startup_s))
                self.adds += 1
            elif decision.action == "drain":
                serving = [g for g in pool if not g.draining and g.ready_at_s <= t]
                if len(serving) > 1:
                    serving[-1].draining = True
                    self.drains += 1
        self.prefill = [g for g in self.prefill if not g.draining]

    def _signals(self, groups: list[_Group], t: float, pool: Role) -> PoolSignals:
        ready = sum(1 for g in groups if g.ready_at_s <= t and not g.draining)
        pending = sum(1 for g in groups if g.ready_at_s > t or g.draining)
        if pool is Role.PREFILL:
            return PoolSignals(
                ready_groups=ready,
                pending_groups=pending,
                latency_p90_s=_p90([v for _, v in self.ttfts]),
                queue_s=_mean([v for _, v in self.prefill_waits]),
                demand=sum(v for _, v in self.arrived_tokens) / self.window_s,
            )
        in_flight = sum(len(g.seqs) for g in groups) + len(self.waiting)
        usage = [len(g.seqs) / self.model.decode_max_seqs for g in groups if g.ready_at_s <= t]
        return PoolSignals(
            ready_groups=ready,
            pending_groups=pending,
            latency_p90_s=_weighted_p90([(itl, n) for _, itl, n in self.itls]),
            queue_s=_mean([v for _, v in self.reservation_waits]),
            kv_usage=max(usage) if usage else None,
            demand=float(in_flight),
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
    return samples[-1][0]


def bench_config(
    ttft_slo_s: float = 2.0, itl_slo_s: float = 0.05, rank_budget: int = 64
) -> AutoscalingConfig:
    """The benchmark's pools: prefill groups of 4 ranks, decode groups of 2, up to 8 each."""
    return AutoscalingConfig(
        prefill=PoolLimits(min_groups=1, max_groups=8, ranks_per_group=4),
        decode=PoolLimits(min_groups=1, max_groups=8, ranks_per_group=2),
        rank_budget=rank_budget,
        ttft_slo_s=ttft_slo_s,
        itl_slo_s=itl_slo_s,
        interval_s=5.0,
        upscale_ticks=2,
        downscale_ticks=24,
        settle_ticks=4,
        margin=0.2,
        kv_usage_target=0.7,
    )


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
    for p in range(config.prefill.min_groups, config.prefill.max_groups + 1):
        for d in range(config.decode.min_groups, config.decode.max_groups + 1):
            ranks = p * config.prefill.ranks_per_group + d * config.decode.ranks_per_group
            if ranks > config.rank_budget:
                continue
            result = Simulation(arrivals, requests, model, config, p, d, autoscale=False).run()
            static.append({"prefill_groups": p, "decode_groups": d, **result.as_dict()})
    matching = [s for s in static if s["slo_attainment"] >= scaled.slo_attainment]
    cheapest = min(matching, key=lambda s: s["rank_seconds"]) if matching else None
    return {
        "requests": len(requests),
        "rate_swing": swing,
        "time_scale": time_scale,
        "autoscaler": scaled.as_dict(),
        "static": static,
        "cheapest_static_at_autoscaler_attainment": cheapest,
        "rank_seconds_ratio": round(scaled.rank_seconds / cheapest["rank_seconds"], 4) if cheapest else None,
    }
