"""The autoscaling policy: each tick, per pool, add a group, drain one, or hold, and say why.

Per pool, in order::

    an action is pending (a group starting or draining)      -> hold "pending"
    the last action finished less than settle_ticks ago       -> hold "settling" (windows lag)
    pressure (any of):  latency p90 > SLO                     ("slo")
                        queue time > its target               ("queue")
                        KV usage >= its target (decode)       ("kv")
                        demand per group >= a per-group load
                        once seen to break the SLO            ("demand")
      for upscale_ticks ticks in a row                        -> add (if max_groups and the budget allow)
    calm for downscale_ticks ticks, above min_groups, and over
      those ticks the peak latency kept 1 - margin of the SLO
      and the peak demand on one group fewer stays within
      1 - margin of the largest per-group load seen within
      the SLO                                                  -> drain

Time to first token includes the wait for a decode slot: while the decode pool's reservation
wait is over its target, a TTFT breach is the decode pool's (its queue pressure), not prefill's,
and prefill neither scales nor learns from it. Nor is a breach prefill's when the window holds
no new prompt token (every prompt was a cache hit): prefill computed nothing, so the time went
elsewhere and a prefill group more would not shorten it.

Capacity is learned online from the same signals: the largest per-group demand served within
the SLO, and the smallest that broke it. No profiling run is needed; until a pool has been seen
to cope, it is never shrunk below the load it carries now. When both pools want a group and the
rank budget holds one, the more violated pool gets it; when the budget is full, a pool in
pressure takes a group from the other pool if that one can shrink safely.

Each tick the planner (planner.py) also sizes each pool from its demand and measured capacity;
its plan, with the latency it predicts at the current and the planned size, is recorded in the
decision's inputs (``plan``) as advice: the rules above still decide the action.

The policy only decides: the caller acts (the controller) and feeds back the groups' states.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import asdict, dataclass, field, replace

from tandem.autoscaler.config import AutoscalingConfig
from tandem.autoscaler.planner import Plan, Planner
from tandem.autoscaler.signals import PoolSignals
from tandem.wire.autoscaler_decision import Decision
from tandem.wire.messages import Role

POOLS = (Role.PREFILL, Role.DECODE)


@dataclass
class _PoolState:
    pressure_ticks: int = 0
    calm_ticks: int = 0
    settle_left: int = 0
    good_per_group: float | None = None  # largest demand per group served within the SLO
    bad_per_group: float | None = None  # smallest demand per group that broke it
    # (latency, demand) of the last downscale_ticks calm ticks: what a drain must still carry
    window: deque[tuple[float, float]] = field(default_factory=deque)

    def reset_calm(self) -> None:
        self.calm_ticks = 0
        self.window.clear()


@dataclass(frozen=True)
class _Want:
    action: str
    rule: str
    severity: float = 0.0


class Autoscaler:
    def __init__(self, config: AutoscalingConfig) -> None:
        self.config = config
        self._state = {pool: _PoolState() for pool in POOLS}
        self.planner = Planner(config)
        self._ticks = 0

    def decide(self, signals: dict[Role, PoolSignals]) -> list[Decision]:
        """One tick: a decision per pool (prefill first). Ticks are ``interval_s`` apart."""
        now_s = self._ticks * self.config.interval_s
        self._ticks += 1
        plans = {pool: self.planner.plan(pool, signals[pool], now_s) for pool in POOLS}
        decode_backed_up = self._decode_backed_up(signals[Role.DECODE])
        wants = {pool: self._want(pool, signals[pool], decode_backed_up) for pool in POOLS}
        self._apply_budget(signals, wants)
        return [self._decision(pool, signals[pool], wants[pool], plans[pool]) for pool in POOLS]

    # -- per pool ------------------------------------------------------------------------------
    def _decode_backed_up(self, decode: PoolSignals) -> bool:
        return decode.queue_s is not None and decode.queue_s > self.config.decode_queue_target_s

    def _want(self, pool: Role, s: PoolSignals, decode_backed_up: bool = False) -> _Want:
        cfg, st = self.config, self._state[pool]
        if s.pending_groups:
            st.pressure_ticks = 0
            st.reset_calm()
            st.settle_left = cfg.settle_ticks
            return _Want("hold", "pending")
        if st.settle_left > 0:
            st.settle_left -= 1
            return _Want("hold", "settling")
        if pool is Role.PREFILL and (decode_backed_up or s.demand == 0):
            s = replace(s, latency_p90_s=None)  # TTFT tells of the decode pool's queue
        self._learn(pool, s)
        pressure = self._pressure(pool, s)
        if pressure is not None:
            st.pressure_ticks += 1
            st.reset_calm()
            if st.pressure_ticks < cfg.upscale_ticks:
                return _Want("hold", f"{pressure[0]} {st.pressure_ticks}/{cfg.upscale_ticks}")
            if s.ready_groups >= cfg.limits(pool).max_groups:
                return _Want("hold", f"{pressure[0]}, at max_groups")
            return _Want("add", pressure[0], pressure[1])
        st.pressure_ticks, st.calm_ticks = 0, st.calm_ticks + 1
        st.window.append((s.latency_p90_s or 0.0, s.demand or 0.0))
        while len(st.window) > cfg.downscale_ticks:
            st.window.popleft()
        if s.ready_groups <= cfg.limits(pool).min_groups:
            return _Want("hold", "at min_groups")
        if st.calm_ticks < cfg.downscale_ticks:
            return _Want("hold", f"calm {st.calm_ticks}/{cfg.downscale_ticks}")
        if not self.can_shrink(pool, s):
            return _Want("hold", "calm, but one group fewer would not keep the SLO")
        return _Want("drain", "calm")

    def _pressure(self, pool: Role, s: PoolSignals) -> tuple[str, float] | None:
        """The strongest pressure on the pool (its rule and severity, > 1), or ``None``."""
        cfg, st = self.config, self._state[pool]
        ratios: list[tuple[float, str]] = []
        if s.latency_p90_s is not None:
            ratios.append((s.latency_p90_s / cfg.slo_s(pool), "slo"))
        if s.queue_s is not None:
            ratios.append((s.queue_s / cfg.queue_target_s(pool), "queue"))
        if pool is Role.DECODE and s.kv_usage is not None:
            ratios.append((s.kv_usage / cfg.kv_usage_target + 1e-9, "kv"))  # at the target counts
        per_group = self._per_group(s)
        if per_group is not None and st.bad_per_group is not None:
            ratios.append((per_group / st.bad_per_group + 1e-9, "demand"))
        over = [(ratio, rule) for ratio, rule in ratios if ratio > 1]
        if not over:
            return None
        ratio, rule = max(over)
        return rule, ratio

    def _learn(self, pool: Role, s: PoolSignals) -> None:
        per_group = self._per_group(s)
        if per_group is None or s.latency_p90_s is None or per_group <= 0:
            return
        st = self._state[pool]
        if s.latency_p90_s <= self.config.slo_s(pool):
            st.good_per_group = max(st.good_per_group or 0.0, per_group)
            if st.bad_per_group is not None and st.bad_per_group <= per_group:
                st.bad_per_group = None  # served within the SLO after all: forget the old breach
        else:
            st.bad_per_group = min(st.bad_per_group or math.inf, per_group)

    @staticmethod
    def _per_group(s: PoolSignals) -> float | None:
        return s.demand / s.ready_groups if s.demand is not None and s.ready_groups > 0 else None

    def can_shrink(self, pool: Role, s: PoolSignals) -> bool:
        """One group fewer keeps the SLO: the pool is above its minimum and, over its last
        ``downscale_ticks`` calm ticks (this one included), its peak latency kept within
        ``1 - margin`` of the SLO and its peak demand spread over one group fewer stays within
        ``1 - margin`` of the largest per-group load seen within the SLO (no demand at all:
        nothing to keep)."""
        cfg, st = self.config, self._state[pool]
        if s.pending_groups or s.ready_groups <= cfg.limits(pool).min_groups:
            return False
        room = 1 - cfg.margin
        latency = max([s.latency_p90_s or 0.0, *(latency for latency, _ in st.window)])
        demand = max([s.demand or 0.0, *(demand for _, demand in st.window)])
        if latency > cfg.slo_s(pool) * room:
            return False
        if not demand:
            return True
        if st.good_per_group is None:
            return False
        return demand / (s.ready_groups - 1) <= st.good_per_group * room

    # -- both pools ----------------------------------------------------------------------------
    def _apply_budget(self, signals: dict[Role, PoolSignals], wants: dict[Role, _Want]) -> None:
        """Grant adds within the rank budget, the more violated pool first; with the budget
        full, make room by draining the other pool when it can shrink safely."""
        cfg = self.config

        def ranks(pool: Role) -> int:
            s = signals[pool]
            return (s.ready_groups + s.pending_groups) * cfg.limits(pool).ranks_per_group

        used = sum(ranks(pool) for pool in POOLS)
        for pool in sorted(POOLS, key=lambda p: -wants[p].severity):
            want = wants[pool]
            if want.action != "add":
                continue
            size = cfg.limits(pool).ranks_per_group
            if used + size <= cfg.rank_budget:
                used += size
                continue
            other = Role.DECODE if pool is Role.PREFILL else Role.PREFILL
            if wants[other].action == "hold" and self._can_give(other, signals[other]):
                wants[other] = _Want("drain", f"budget: room for {pool.value}")
                wants[pool] = _Want("hold", f"{want.rule}, budget full: draining {other.value} first")
            else:
                wants[pool] = _Want("hold", f"{want.rule}, budget full")

    def _can_give(self, pool: Role, s: PoolSignals) -> bool:
        return self._pressure(pool, s) is None and self.can_shrink(pool, s)

    def _decision(self, pool: Role, s: PoolSignals, want: _Want, plan: Plan | None = None) -> Decision:
        st = self._state[pool]
        if want.action == "add":
            st.pressure_ticks = 0
        if want.action == "drain":
            st.reset_calm()
        step = {"add": 1, "drain": -1}.get(want.action, 0)
        inputs = {
            **asdict(s),
            "pressure_ticks": st.pressure_ticks,
            "calm_ticks": st.calm_ticks,
            "good_per_group": st.good_per_group,
            "bad_per_group": st.bad_per_group,
            "severity": round(want.severity, 4),
            "plan": _finite(asdict(plan)) if plan is not None else None,
        }
        return Decision(pool.value, want.action, want.rule, s.ready_groups, s.ready_groups + step, inputs)


def _finite(values: dict[str, object]) -> dict[str, object]:
    """Infinite figures (a size that cannot keep up) as ``None``: the inputs are strict JSON."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}
