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

Once the planner (planner.py) has measured a pool's capacity, its plan decides that pool
instead of the rules above: the pool grows to the planned size when the plan has asked for more
groups than it has for ``upscale_ticks`` ticks in a row (all the missing groups at once, as the
budget allows), and an SLO breach lasting as long still adds a group the plan did not foresee;
it shrinks to the largest plan of ``downscale_ticks`` calm ticks in which the plan stayed
below its size and the peak latency kept ``1 - margin`` of the SLO (queue time, KV usage and demand
enter through the plan: its backlog, sequences and forecast). The rule is ``plan``. Every
decision records the plan, with the latency it predicts at the current and the planned size, in
its inputs (``plan``); until a pool is measured the plan is ``None`` and the rules decide.

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
    last_action: str | None = None  # "add" or "drain", the last carried out
    plans: deque[int] = field(default_factory=deque)  # the planned sizes of the calm ticks

    def reset_calm(self) -> None:
        self.calm_ticks = 0
        self.window.clear()
        self.plans.clear()

    def calm(self, s: PoolSignals, planned: int | None, ticks: int) -> None:
        """One calm tick: counted, and its latency, demand and plan kept for the last ``ticks``."""
        self.pressure_ticks, self.calm_ticks = 0, self.calm_ticks + 1
        self.window.append((s.latency_p90_s or 0.0, s.demand or 0.0))
        if planned is not None:
            self.plans.append(planned)
        for kept in (self.window, self.plans):
            while len(kept) > ticks:
                kept.popleft()


@dataclass(frozen=True)
class _Want:
    action: str
    rule: str
    severity: float = 0.0
    count: int = 1  # groups to add or drain


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
        own = self._own_latencies(signals)
        plans = {pool: self.planner.plan(pool, own[pool], now_s) for pool in POOLS}
        wants = {pool: self._want(pool, own[pool], plans[pool]) for pool in POOLS}
        self._apply_budget(signals, wants, plans)
        return [self._decision(pool, signals[pool], wants[pool], plans[pool]) for pool in POOLS]

    def _own_latencies(self, signals: dict[Role, PoolSignals]) -> dict[Role, PoolSignals]:
        """Each pool's signals with only the latency it is the cause of: prefill's TTFT is
        withheld while the decode pool's reservation wait is over its target or when the window
        computed no prompt token (neither rules nor planner learn from it)."""
        prefill = signals[Role.PREFILL]
        if self._decode_backed_up(signals[Role.DECODE]) or prefill.demand == 0:
            prefill = replace(prefill, latency_p90_s=None)
        return {Role.PREFILL: prefill, Role.DECODE: signals[Role.DECODE]}

    # -- per pool ------------------------------------------------------------------------------
    def _decode_backed_up(self, decode: PoolSignals) -> bool:
        return decode.queue_s is not None and decode.queue_s > self.config.decode_queue_target_s

    def _want(self, pool: Role, s: PoolSignals, plan: Plan | None = None) -> _Want:
        cfg, st = self.config, self._state[pool]
        if s.pending_groups and plan is not None and st.last_action == "add":
            more = plan.groups - s.ready_groups - s.pending_groups
            room = cfg.limits(pool).max_groups - s.ready_groups - s.pending_groups
            if more > 0 and room > 0:  # the load outgrew the groups still starting: start more now
                return _Want("add", "plan, more while starting", plan.needed / max(s.ready_groups, 1),
                             min(more, room))  # fmt: skip
        if s.pending_groups:
            st.pressure_ticks = 0
            st.reset_calm()
            st.settle_left = cfg.settle_ticks
            return _Want("hold", "pending")
        if st.settle_left > 0:
            st.settle_left -= 1
            return _Want("hold", "settling")
        self._learn(pool, s)
        pressure = self._pressure(pool, s)
        if plan is not None:
            return self._want_planned(pool, s, plan, pressure)
        if pressure is not None:
            st.pressure_ticks += 1
            st.reset_calm()
            if st.pressure_ticks < cfg.upscale_ticks:
                return _Want("hold", f"{pressure[0]} {st.pressure_ticks}/{cfg.upscale_ticks}")
            if s.ready_groups >= cfg.limits(pool).max_groups:
                return _Want("hold", f"{pressure[0]}, at max_groups")
            return _Want("add", pressure[0], pressure[1])
        st.calm(s, None, cfg.downscale_ticks)
        held = self._calm_hold(pool, s)
        if held is not None:
            return held
        if not self.can_shrink(pool, s):
            return _Want("hold", "calm, but one group fewer would not keep the SLO")
        return _Want("drain", "calm")

    def _want_planned(
        self, pool: Role, s: PoolSignals, plan: Plan, pressure: tuple[str, float] | None
    ) -> _Want:
        """The plan decides; an SLO breach is the one reactive pressure left (see above)."""
        cfg, st = self.config, self._state[pool]
        limits, ready = cfg.limits(pool), s.ready_groups
        breach = pressure[1] if pressure is not None and pressure[0] == "slo" else None
        if plan.groups > ready or breach is not None:
            st.pressure_ticks += 1
            st.reset_calm()
            rule = "plan" if plan.groups > ready else "slo"
            if st.pressure_ticks < cfg.upscale_ticks:
                return _Want("hold", f"{rule} {st.pressure_ticks}/{cfg.upscale_ticks}")
            if ready >= limits.max_groups:
                return _Want("hold", f"{rule}, at max_groups")
            count = min(max(plan.groups - ready, 1), limits.max_groups - ready)
            severity = max(plan.needed / max(ready, 1), breach or 0.0)
            return _Want("add", rule, severity, count)
        st.calm(s, plan.groups, cfg.downscale_ticks)  # every calm tick's plan, the waiting ones included
        held = self._calm_hold(pool, s)
        if held is not None:
            return held
        keep = max(st.plans)  # the largest plan of the calm window: one low tick is no trend
        if keep >= ready:
            return _Want("hold", f"calm, the plan keeps {ready} groups")
        if not self._latency_kept(pool, s):
            return _Want("hold", "calm, but the latency peaked within the margin of the SLO")
        return _Want("drain", "plan", count=ready - max(keep, limits.min_groups))

    def _calm_hold(self, pool: Role, s: PoolSignals) -> _Want | None:
        """A calm pool holds at its minimum, and until its calm window is full."""
        cfg, st = self.config, self._state[pool]
        if s.ready_groups <= cfg.limits(pool).min_groups:
            return _Want("hold", "at min_groups")
        if st.calm_ticks < cfg.downscale_ticks:
            return _Want("hold", f"calm {st.calm_ticks}/{cfg.downscale_ticks}")
        return None

    def _latency_kept(self, pool: Role, s: PoolSignals) -> bool:
        """Over the calm window (this tick included) the peak latency kept ``1 - margin`` of the
        SLO: the pool had room to give."""
        st = self._state[pool]
        latency = max([s.latency_p90_s or 0.0, *(latency for latency, _ in st.window)])
        return latency <= self.config.slo_s(pool) * (1 - self.config.margin)

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
        demand = max([s.demand or 0.0, *(demand for _, demand in st.window)])
        if not self._latency_kept(pool, s):
            return False
        if not demand:
            return True
        if st.good_per_group is None:
            return False
        return demand / (s.ready_groups - 1) <= st.good_per_group * room

    # -- both pools ----------------------------------------------------------------------------
    def _apply_budget(
        self,
        signals: dict[Role, PoolSignals],
        wants: dict[Role, _Want],
        plans: dict[Role, Plan | None] | None = None,
    ) -> None:
        """Grant adds within the rank budget, the more violated pool first (as many of the
        groups asked for as the budget holds); with the budget full, make room by draining the
        other pool when it can shrink safely."""
        plans = plans or {}
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
            granted = min(want.count, (cfg.rank_budget - used) // size)
            if granted >= 1:
                used += granted * size
                if granted < want.count:
                    rule = f"{want.rule}, budget grants {granted} of {want.count}"
                    wants[pool] = replace(want, rule=rule, count=granted)
                continue
            other = Role.DECODE if pool is Role.PREFILL else Role.PREFILL
            if wants[other].action == "hold" and self._can_give(other, signals[other], plans.get(other)):
                wants[other] = _Want("drain", f"budget: room for {pool.value}")
                wants[pool] = _Want("hold", f"{want.rule}, budget full: draining {other.value} first")
            else:
                wants[pool] = _Want("hold", f"{want.rule}, budget full")

    def _can_give(self, pool: Role, s: PoolSignals, plan: Plan | None = None) -> bool:
        if plan is not None:
            return (
                not s.pending_groups
                and s.ready_groups > max(plan.groups, self.config.limits(pool).min_groups)
                and self._latency_kept(pool, s)
            )
        return self._pressure(pool, s) is None and self.can_shrink(pool, s)

    def _decision(self, pool: Role, s: PoolSignals, want: _Want, plan: Plan | None = None) -> Decision:
        st = self._state[pool]
        if want.action != "hold":
            st.last_action = want.action
        if want.action == "add":
            st.pressure_ticks = 0
        if want.action == "drain":
            st.reset_calm()
        step = {"add": want.count, "drain": -want.count}.get(want.action, 0)
        base = s.ready_groups + (s.pending_groups if want.rule.startswith("plan, more") else 0)
        inputs = {
            **asdict(s),
            "pressure_ticks": st.pressure_ticks,
            "calm_ticks": st.calm_ticks,
            "good_per_group": st.good_per_group,
            "bad_per_group": st.bad_per_group,
            "severity": round(want.severity, 4),
            "plan": _finite(asdict(plan)) if plan is not None else None,
        }
        return Decision(
            pool.value, want.action, want.rule, s.ready_groups, base + step, inputs, s.pending_groups
        )


def _finite(values: dict[str, object]) -> dict[str, object]:
    """Infinite figures (a size that cannot keep up) as ``None``: the inputs are strict JSON."""
    return {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in values.items()}
