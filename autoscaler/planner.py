"""The planner: each pool's size from the demand it must serve by the time a group started now
would serve, divided by what one group delivers within the SLO, as measured on this deployment.

Per tick and pool, from its :class:`PoolSignals`::

    learn      capacity from the window (capacity.py), the forecast from its demand (forecast.py)
    horizon  = group_start_s + interval_s + signal_window_s / 2
               (a group decided now serves after it starts; the signal lags half its window)
    ahead    = the forecast demand within the horizon
    prefill  n * C * utilization_target >= ahead + backlog / backlog_drain_s
             and n * C >= burst * w / (w + (1 - margin) * SLO - service)
             and the predicted TTFT at n groups <= (1 - margin) * SLO
             (C: one group's tokens/s at the window's prompt length; burst: the arrival
              rate's peak over w = BURST_WINDOW_S to be ready for at the current arrival level,
              forecast.BurstHeadroom; a burst at that rate for w seconds leaves a backlog the
              groups clear within the SLO's room past a prompt's own compute, ``service``)
    decode   n >= ahead / S   (ahead: of the sequences in flight and those waiting for a slot)
             (S: the sequences one group holds within (1 - margin) * SLO and its KV filled to
              the usage target)
    groups   = the smallest such n within [min_groups, max_groups]

Until a pool's capacity has been measured, its plan is ``None`` and the reactive rules decide.
The plan also says what it expects: the predicted latency at the pool's current size and at the
planned one (prefill's TTFT; decode's ITL), the figures of an advisory output.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any

from tandem.autoscaler.capacity import DecodeCapacity, PrefillCapacity
from tandem.autoscaler.config import AutoscalingConfig
from tandem.autoscaler.forecast import BurstHeadroom, TrendForecast
from tandem.autoscaler.signals import BURST_WINDOW_S, PoolSignals
from tandem.wire.messages import Role


@dataclass(frozen=True, kw_only=True)
class PlannerConfig:
    utilization_target: float = 0.9
    group_start_s: float = 60.0
    signal_window_s: float = 60.0
    backlog_drain_s: float = 30.0
    forecast_ticks: int = 12
    peak_window_s: float = 120.0
    growth_history_s: float = 1800.0
    growth_quantile: float = 0.9
    kv_tokens_per_decode_group: float | None = None
    burst_window_s: float = BURST_WINDOW_S  # the range demand_peak's rate is read over
    burst_quantile: float | None = 0.9  # of the peak-to-level ratios; None: no burst headroom

    def __post_init__(self) -> None:
        if not 0 < self.utilization_target <= 1:
            raise ValueError(f"utilization_target: must be in (0, 1], got {self.utilization_target!r}")
        for name in ("group_start_s", "signal_window_s", "peak_window_s", "growth_history_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: must be a number of seconds >= 0, got {value!r}")
        for name in ("backlog_drain_s", "burst_window_s"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not math.isfinite(value) or not value > 0:
                raise ValueError(f"{name}: must be a positive number of seconds, got {value!r}")
        kv = self.kv_tokens_per_decode_group
        if kv is not None and not kv > 0:
            raise ValueError(f"kv_tokens_per_decode_group: must be positive, got {kv!r}")


@dataclass(frozen=True)
class Plan:
    """``groups`` the planned size; ``needed`` the unrounded groups the demand asks for;
    ``basis`` what bound it (``throughput``, ``burst``, ``ttft``, ``sequences``, ``min_groups``,
    ``max_groups``); the demand now and ahead, one group's capacity, and the predicted latency at
    the current and the planned size (``None`` where no prediction is possible)."""

    pool: str
    groups: int
    needed: float
    basis: str
    demand: float
    demand_ahead: float
    capacity_per_group: float
    predicted_now_s: float | None
    predicted_planned_s: float | None


@dataclass
class Planner:
    config: AutoscalingConfig
    planner: PlannerConfig = PlannerConfig()
    prefill: PrefillCapacity = field(default_factory=PrefillCapacity)
    decode: DecodeCapacity = field(default_factory=DecodeCapacity)
    forecasts: dict[Role, TrendForecast] = field(default_factory=dict)
    bursts: BurstHeadroom | None = None

    def __post_init__(self) -> None:
        p = self.planner
        for pool in (Role.PREFILL, Role.DECODE):
            self.forecasts.setdefault(
                pool,
                TrendForecast(p.forecast_ticks, p.peak_window_s, p.growth_history_s, p.growth_quantile),
            )
        if self.bursts is None and p.burst_quantile is not None:
            self.bursts = BurstHeadroom(p.forecast_ticks, p.burst_quantile, p.growth_history_s)
        if p.kv_tokens_per_decode_group is not None:
            self.decode.kv_tokens_per_group = p.kv_tokens_per_decode_group

    @property
    def horizon_s(self) -> float:
        p = self.planner
        return p.group_start_s + self.config.interval_s + p.signal_window_s / 2

    def plan(self, pool: Role, s: PoolSignals, now_s: float) -> Plan | None:
        """Learn from this tick's signals and plan the pool; ``None`` while unmeasured."""
        if pool is Role.PREFILL:
            return self._plan_prefill(s, now_s)
        return self._plan_decode(s, now_s)

    def _bounded(self, pool: Role, needed: float, basis: str) -> tuple[int, str]:
        limits = self.config.limits(pool)
        groups = math.ceil(needed - 1e-9)
        if groups < limits.min_groups:
            return limits.min_groups, "min_groups"
        if groups > limits.max_groups:
            return limits.max_groups, "max_groups"
        return groups, basis

    def _plan_prefill(self, s: PoolSignals, now_s: float) -> Plan | None:
        cap, room = self.prefill, 1 - self.config.margin
        s = _finite(s)
        demand, prompt = s.demand, s.prompt_tokens
        if demand is not None and prompt and s.busy_groups is not None:
            cap.observe(demand, s.busy_groups, prompt)
            if s.latency_p90_s is not None and s.ready_groups > 0:
                cap.correct(s.latency_p90_s, demand, prompt, s.ready_groups)
        forecast = self.forecasts[Role.PREFILL]
        forecast.observe(now_s, demand or 0.0)  # no sample in the window: no traffic
        if self.bursts is not None:
            self.bursts.observe(now_s, s.arrival_rate, s.demand_peak)
        ahead = forecast.predict(self.horizon_s)
        if prompt is None and cap.per_bucket:  # no request in the window: the last bucket seen
            prompt = 2.0 ** max(cap.per_bucket)
        rate = cap.per_group(prompt) if prompt else None
        if rate is None or ahead is None or prompt is None:
            return None
        load = ahead + (s.backlog or 0.0) / self.planner.backlog_drain_s
        needed = load / (rate * self.planner.utilization_target)
        basis = "throughput"
        burst = self.bursts.peak() if self.bursts is not None else None
        if burst:
            w = self.planner.burst_window_s
            drain_s = max(0.0, self.config.ttft_slo_s * room - prompt / rate)
            if (by_burst := burst * w / (w + drain_s) / rate) > needed:
                needed, basis = by_burst, "burst"
        limits = self.config.limits(Role.PREFILL)
        n = max(1, math.ceil(needed - 1e-9))
        slo = self.config.ttft_slo_s * room
        # a prompt's own compute time past the SLO: no size meets it, and more groups would not
        # shorten it (only the wait); the throughput's size it is
        reachable = _within(cap.predict_ttft_s(0.0, prompt, 1), slo)
        while reachable and n < limits.max_groups and not _within(cap.predict_ttft_s(load, prompt, n), slo):
            n, basis = n + 1, "ttft"
        if basis == "ttft":
            needed = float(n)
        groups, basis = self._bounded(Role.PREFILL, needed, basis)
        return Plan(
            Role.PREFILL.value,
            groups,
            round(needed, 4),
            basis,
            demand or 0.0,
            ahead,
            rate,
            cap.predict_ttft_s(load, prompt, s.ready_groups) if s.ready_groups else None,
            cap.predict_ttft_s(load, prompt, groups),
        )

    def _plan_decode(self, s: PoolSignals, now_s: float) -> Plan | None:
        cap, room = self.decode, 1 - self.config.margin
        s = _finite(s)
        running = s.demand
        ctx = s.context_tokens or 0.0
        if running is not None and s.ready_groups > 0:
            if s.latency_p90_s is not None:
                cap.observe(running / s.ready_groups, ctx, s.latency_p90_s)
            if s.kv_usage is not None:
                cap.observe_fill(running / s.ready_groups, s.kv_usage)
        forecast = self.forecasts[Role.DECODE]
        forecast.observe(now_s, (running or 0.0) + (s.backlog or 0.0))
        ahead = forecast.predict(self.horizon_s)
        per_group = cap.seqs_per_group(self.config.itl_slo_s * room, ctx, self.config.kv_usage_target)
        if per_group is None or ahead is None:
            return None
        needed = float(self.config.decode.max_groups) if per_group <= 0 else ahead / per_group
        groups, basis = self._bounded(Role.DECODE, needed, "sequences")
        now_n = s.ready_groups
        return Plan(
            Role.DECODE.value,
            groups,
            round(needed, 4),
            basis,
            running or 0.0,
            ahead,
            per_group,
            cap.predict_itl_s(ahead / now_n, ctx) if now_n else None,
            cap.predict_itl_s(ahead / groups, ctx),
        )


def _finite(s: PoolSignals) -> PoolSignals:
    """The signals with every infinite or NaN figure as absent: a ratio over an empty rate, or a
    latency past the histogram's last bucket, says nothing a capacity can be learned from."""
    changes: dict[str, Any] = {
        name: None
        for name in (
            "latency_p90_s",
            "kv_usage",
            "demand",
            "busy_groups",
            "backlog",
            "prompt_tokens",
            "context_tokens",
            "demand_peak",
            "arrival_rate",
        )
        if (value := getattr(s, name)) is not None and not math.isfinite(value)
    }
    return replace(s, **changes) if changes else s


def _within(predicted: float | None, bound: float) -> bool:
    return predicted is not None and predicted <= bound
