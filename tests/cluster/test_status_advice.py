"""``tandem status`` shows the autoscaler's latest decision per pool and the planner's advice
beside it: the planned size, what bounds it, and the latency predicted at the current and the
planned size. Fed by the policy's own decisions."""

from __future__ import annotations

import json

from tandem.autoscaler.config import AutoscalingConfig, PoolLimits
from tandem.autoscaler.policy import Autoscaler
from tandem.autoscaler.signals import PoolSignals
from tandem.cluster.deployment import autoscaler_advice, describe
from tandem.wire.messages import Role
from tandem.wire.routing_view import RoutingView

CONFIG = AutoscalingConfig(
    prefill=PoolLimits(min_groups=1, max_groups=4, ranks_per_group=2),
    decode=PoolLimits(min_groups=1, max_groups=4, ranks_per_group=2),
    rank_budget=16,
)


def _view(decisions: tuple = ()) -> RoutingView:
    return RoutingView({}, {}, (), 16, 1024, 1024, autoscaler_decisions=decisions)


def test_status_shows_each_pools_latest_decision_and_the_plan_beside_it() -> None:
    scaler = Autoscaler(CONFIG)
    prefill = PoolSignals(
        ready_groups=1, latency_p90_s=0.4, demand=6_000.0, busy_groups=0.4, prompt_tokens=3000.0
    )
    decode = PoolSignals(ready_groups=1, latency_p90_s=0.03, kv_usage=0.2, demand=4.0)
    decisions = []
    for tick in range(3):
        decisions += [(100.0 + tick, d) for d in scaler.decide({Role.PREFILL: prefill, Role.DECODE: decode})]
    advice = autoscaler_advice(_view(tuple(decisions)))
    assert advice is not None and sorted(advice) == ["decode", "prefill"]
    p = advice["prefill"]
    assert p["at"] == 102.0 and (p["action"], p["ready_groups"]) == ("hold", 1)
    # 6k tokens/s at 15k per busy group-second: one group (its p90 TTFT 0.2 s of compute and
    # 0.46 s of waiting, within the 1 s SLO's margin)
    assert (p["planned_groups"], p["plan_basis"]) == (1, "throughput")
    assert p["predicted_latency_now_s"] == p["predicted_latency_planned_s"] > 3000 / 15_000
    d = advice["decode"]  # one batch size seen: no latency fit, no plan
    assert d["planned_groups"] is None and d["predicted_latency_now_s"] is None
    assert json.loads(json.dumps(describe(_view(tuple(decisions)))))["autoscaler"] == advice


def test_status_says_the_autoscaler_is_off() -> None:
    assert describe(_view())["autoscaler"] is None
