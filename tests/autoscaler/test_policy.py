"""The autoscaling policy against scripted signals: it scales the pool whose SLO breaks, waits
out spikes and oscillations, keeps to the rank budget (giving it to the worse pool), ignores
samples while an action is pending or settling, and shrinks only after a calm window and when
one group fewer would keep the SLO."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from tandem.autoscaler.config import AutoscalingConfig, PoolLimits
from tandem.autoscaler.planner import Planner, PlannerConfig
from tandem.autoscaler.policy import Autoscaler
from tandem.autoscaler.signals import PoolSignals
from tandem.wire.autoscaler_decision import Decision
from tandem.wire.messages import Role

P, D = Role.PREFILL, Role.DECODE
CONFIG = AutoscalingConfig(
    prefill=PoolLimits(min_groups=1, max_groups=3, ranks_per_group=2),
    decode=PoolLimits(min_groups=1, max_groups=3, ranks_per_group=2),
    rank_budget=8,
    ttft_slo_s=1.0,
    itl_slo_s=0.1,
    upscale_ticks=2,
    downscale_ticks=4,
    settle_ticks=1,
)
CALM_P = PoolSignals(ready_groups=1, latency_p90_s=0.3, queue_s=0.01, demand=1000.0)
CALM_D = PoolSignals(ready_groups=1, latency_p90_s=0.03, queue_s=0.01, kv_usage=0.3, demand=8.0)


def _tick(
    scaler: Autoscaler, prefill: PoolSignals = CALM_P, decode: PoolSignals = CALM_D
) -> dict[Role, Decision]:
    decisions = scaler.decide({P: prefill, D: decode})
    assert [d.pool for d in decisions] == ["prefill", "decode"]
    return {P: decisions[0], D: decisions[1]}


def test_prefill_scales_up_on_a_ttft_breach_and_decode_on_an_itl_breach() -> None:
    scaler = Autoscaler(CONFIG)
    slow_ttft = replace(CALM_P, latency_p90_s=2.5)
    first = _tick(scaler, prefill=slow_ttft)
    assert first[P].action == "hold" and first[P].rule == "slo 1/2"  # one tick is not enough
    second = _tick(scaler, prefill=slow_ttft)
    assert (second[P].action, second[P].rule, second[P].desired_groups) == ("add", "slo", 2)
    assert second[D].action == "hold"
    scaler = Autoscaler(CONFIG)
    slow_itl = replace(CALM_D, latency_p90_s=0.25)
    _tick(scaler, decode=slow_itl)
    decided = _tick(scaler, decode=slow_itl)
    assert (decided[D].action, decided[D].rule) == ("add", "slo") and decided[P].action == "hold"


def test_a_ttft_breach_with_no_prompt_token_computed_is_not_prefills() -> None:
    """Every prompt in the window was a cache hit (no new prompt token): the slow first tokens
    waited elsewhere, so prefill holds, and it does not learn a per-group load from them."""
    scaler = Autoscaler(CONFIG)
    all_cached = replace(CALM_P, latency_p90_s=2.5, demand=0.0)
    ticks = [_tick(scaler, prefill=all_cached)[P] for _ in range(4)]
    assert [t.action for t in ticks] == ["hold"] * 4 and "slo" not in {t.rule for t in ticks}
    assert ticks[-1].inputs["bad_per_group"] is None
    # the same latency with prompt tokens computed is prefill's breach
    computed = replace(all_cached, demand=500.0)
    _tick(scaler, prefill=computed)
    assert _tick(scaler, prefill=computed)[P].rule == "slo"


def test_kv_usage_and_queue_time_are_pressure_too() -> None:
    scaler = Autoscaler(CONFIG)
    full = replace(CALM_D, kv_usage=0.8)  # at the target
    _tick(scaler, decode=full)
    assert _tick(scaler, decode=full)[D].rule == "kv"
    scaler = Autoscaler(CONFIG)
    queued = replace(CALM_P, queue_s=2.0)
    _tick(scaler, prefill=queued)
    assert _tick(scaler, prefill=queued)[P].rule == "queue"


def test_a_single_spike_does_not_scale() -> None:
    scaler = Autoscaler(CONFIG)
    actions = [
        _tick(scaler, prefill=replace(CALM_P, latency_p90_s=5.0) if t == 3 else CALM_P)[P].action
        for t in range(10)
    ]
    assert actions == ["hold"] * 10


def test_a_load_oscillating_between_two_groups_and_one_does_not_flap() -> None:
    """Pressure for two ticks, calm for three, over and over: one add, then no drain (the calm
    never lasts the window), so the pool does not go 2 -> 1 -> 2."""
    scaler = Autoscaler(CONFIG)
    groups = 1
    history = []
    for t in range(40):
        busy = t % 5 < 2
        pending = 1 if history and history[-1] != "hold" else 0
        prefill = PoolSignals(
            ready_groups=groups,
            pending_groups=pending,
            latency_p90_s=(2.0 if groups == 1 else 0.9) if busy else 0.2,
            demand=4000.0 if busy else 1000.0,
        )
        decision = _tick(scaler, prefill=prefill)[P]
        history.append(decision.action)
        groups = decision.desired_groups if decision.action != "hold" else groups
    assert history.count("add") == 1 and history.count("drain") == 0, history


def test_the_budget_is_kept_and_goes_to_the_more_violated_pool() -> None:
    config = replace(CONFIG, rank_budget=6)  # room for one more 2-rank group over 2 + 2
    scaler = Autoscaler(config)
    prefill = replace(CALM_P, latency_p90_s=1.5)  # 1.5x its SLO
    decode = replace(CALM_D, latency_p90_s=0.4)  # 4x its SLO: the worse
    _tick(scaler, prefill, decode)
    decided = _tick(scaler, prefill, decode)
    assert decided[D].action == "add" and decided[P].action == "hold"
    assert decided[P].rule == "slo, budget full"
    # with the budget full, a pool in pressure never grows past it
    full = _tick(scaler, replace(prefill, ready_groups=1), replace(decode, ready_groups=2))
    assert full[P].action == "hold" and full[D].action == "hold"


def test_a_full_budget_is_made_room_for_from_a_pool_that_can_shrink() -> None:
    scaler = Autoscaler(replace(CONFIG, rank_budget=6, downscale_ticks=6))
    idle_decode = PoolSignals(ready_groups=2, latency_p90_s=0.02, kv_usage=0.1, demand=2.0)
    # the decode pool is seen to keep its ITL with 4 sequences a group, its KV 30% full: its peak
    # fits one group (the planner's bound: 0.8 of 4 / 0.3 sequences)
    _tick(scaler, decode=replace(idle_decode, demand=8.0, kv_usage=0.3))
    slow = replace(CALM_P, latency_p90_s=3.0)
    first = _tick(scaler, prefill=slow, decode=idle_decode)
    assert first[P].rule == "slo 1/2" and first[D].rule == "calm 2/6"
    decided = _tick(scaler, prefill=slow, decode=idle_decode)
    assert decided[D].action == "drain" and decided[D].rule == "budget: room for prefill"
    assert decided[P].action == "hold" and "draining decode first" in decided[P].rule


def test_nothing_happens_while_an_action_is_pending_and_its_samples_are_ignored() -> None:
    scaler = Autoscaler(CONFIG)
    slow = replace(CALM_P, latency_p90_s=3.0)
    _tick(scaler, prefill=slow)
    assert _tick(scaler, prefill=slow)[P].action == "add"
    warming = replace(slow, ready_groups=1, pending_groups=1)  # the new group is starting
    for _ in range(5):
        decided = _tick(scaler, prefill=warming)[P]
        assert (decided.action, decided.rule) == ("hold", "pending")
    ready = replace(slow, ready_groups=2)
    assert _tick(scaler, prefill=ready)[P].rule == "settling"  # the window still holds the start-up
    # the streak starts over after the action: the stale breach before it counts for nothing
    assert _tick(scaler, prefill=ready)[P].rule == "slo 1/2"
    assert _tick(scaler, prefill=ready)[P].action == "add"


def test_scale_down_waits_for_its_window_and_a_safe_projection() -> None:
    scaler = Autoscaler(CONFIG)
    two = PoolSignals(ready_groups=2, latency_p90_s=0.3, demand=1000.0)
    # seen once: a group carries 1500 tokens/s within the SLO; that tick's 3000 would be too
    # much for one group, so the drain waits until it has left the calm window
    first = _tick(scaler, prefill=replace(two, demand=3000.0))[P]
    rules = [first] + [_tick(scaler, prefill=two)[P] for _ in range(4)]
    assert [r.action for r in rules] == ["hold", "hold", "hold", "hold", "drain"], [r.rule for r in rules]
    assert [r.rule for r in rules[:4]] == [
        "calm 1/4", "calm 2/4", "calm 3/4", "calm, but one group fewer would not keep the SLO"
    ]  # fmt: skip
    assert rules[-1].desired_groups == 1
    # a demand one group could not carry within the margin keeps both groups
    scaler = Autoscaler(CONFIG)
    _tick(scaler, prefill=replace(two, demand=3000.0))
    heavy = replace(two, demand=2800.0)  # 2800 on one group > 1500 * 0.8
    decisions = [_tick(scaler, prefill=heavy)[P] for _ in range(8)]
    assert all(d.action == "hold" for d in decisions)
    assert decisions[-1].rule == "calm, but one group fewer would not keep the SLO"


def test_an_idle_pool_drains_to_its_minimum_and_stops_there() -> None:
    scaler = Autoscaler(CONFIG)
    groups, actions = 3, []
    for _ in range(30):
        idle = PoolSignals(ready_groups=groups)  # no traffic: no samples in the windows
        decision = _tick(scaler, prefill=idle)[P]
        actions.append(decision.action)
        groups = decision.desired_groups
    assert actions.count("drain") == 2 and groups == 1


def test_each_decision_is_a_json_line_with_its_inputs() -> None:
    scaler = Autoscaler(CONFIG)
    _tick(scaler, prefill=replace(CALM_P, latency_p90_s=2.0))
    line = json.loads(_tick(scaler, prefill=replace(CALM_P, latency_p90_s=2.0))[P].to_json())
    assert line["event"] == "autoscaler_decision" and line["pool"] == "prefill" and line["action"] == "add"
    assert line["inputs"]["latency_p90_s"] == 2.0 and line["inputs"]["severity"] == 2.0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"rank_budget": 3}, "rank_budget: 3 ranks cannot hold both pools' minimum (4)"),
        ({"itl_slo_s": 0}, "itl_slo_s: must be a positive number of seconds"),
        ({"margin": 1.0}, "margin: must be in [0, 1)"),
    ],
)
def test_a_bad_configuration_names_its_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as error:
        replace(CONFIG, **change)  # type: ignore[arg-type]
    assert message in str(error.value)


def test_pool_limits_are_checked() -> None:
    with pytest.raises(ValueError, match=r"min_groups \(3\) exceeds max_groups \(2\)"):
        PoolLimits(min_groups=3, max_groups=2)
    with pytest.raises(ValueError, match="ranks_per_group: must be an integer >= 1"):
        PoolLimits(ranks_per_group=0)


def test_an_unreachable_prometheus_is_a_clear_error() -> None:
    import socket

    from tandem.autoscaler.prometheus_source import PrometheusQueryError, PrometheusSource

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    source = PrometheusSource(f"http://127.0.0.1:{port}", "tiny", timeout_s=2.0)
    with pytest.raises(PrometheusQueryError, match=f"Prometheus at http://127.0.0.1:{port} could not answer"):
        source.read()


def test_each_decision_records_the_planners_advice_once_capacity_is_measured() -> None:
    """The plan is advice in the inputs: None while the pool is unmeasured; then the planned
    size from demand over the measured per-group rate, with the TTFT it predicts at the current
    and the planned size (an overloaded size's infinite TTFT recorded as None: strict JSON)."""
    scaler = Autoscaler(CONFIG)
    loaded = PoolSignals(
        ready_groups=1,
        latency_p90_s=0.5,
        queue_s=0.01,
        demand=15_000.0,
        busy_groups=1.0,
        prompt_tokens=2000.0,
    )
    unmeasured = replace(loaded, busy_groups=None)  # no busy-time figure: no capacity known
    assert _tick(scaler, prefill=unmeasured)[P].inputs["plan"] is None
    for _ in range(3):
        decided = _tick(scaler, prefill=loaded)
    plan = decided[P].inputs["plan"]
    assert plan is not None and plan["capacity_per_group"] == pytest.approx(15_000.0)
    assert plan["groups"] == 2 and plan["needed"] == pytest.approx(1 / 0.9, rel=1e-3)
    assert plan["predicted_now_s"] is None  # one group at 15k/s of 15k/s: saturated
    assert plan["predicted_planned_s"] is not None and plan["predicted_planned_s"] > 2000 / 15_000
    json.loads(decided[P].to_json(), parse_constant=lambda c: pytest.fail(f"non-JSON {c}"))


def _measured(groups: int, demand: float, *, pending: int = 0, backlog: float = 0.0,
              ttft: float = 0.3) -> PoolSignals:  # fmt: skip
    """A prefill window whose groups compute 10k tokens per busy second, on 2k-token prompts."""
    return PoolSignals(
        ready_groups=groups,
        pending_groups=pending,
        latency_p90_s=ttft,
        queue_s=0.01,
        demand=demand,
        busy_groups=min(groups, demand / 10_000.0),
        backlog=backlog,
        prompt_tokens=2000.0,
    )


def test_a_measured_pool_grows_to_its_plan_at_once_as_far_as_the_budget_allows() -> None:
    """Saturated (10k tokens/s computed by one group) with 600k tokens queued, the plan asks for
    (10k + 600k / 30 s) / (10k * 0.9) = 3.3 -> 4 groups: after upscale_ticks ticks the pool
    adds what the budget holds (two groups of 2 ranks beside decode's 2), in one decision."""
    scaler = Autoscaler(replace(CONFIG, prefill=PoolLimits(min_groups=1, max_groups=4, ranks_per_group=2)))
    first = _tick(scaler, prefill=_measured(1, 10_000.0, backlog=600_000.0))[P]
    assert first.action == "hold" and first.rule == "plan 1/2" and first.inputs["plan"]["groups"] == 4
    added = _tick(scaler, prefill=_measured(1, 10_000.0, backlog=600_000.0))[P]
    assert (added.action, added.rule) == ("add", "plan, budget grants 2 of 3")
    assert added.desired_groups == 3 and added.count == 2


def test_a_load_that_outgrows_the_groups_still_starting_starts_more() -> None:
    config = replace(
        CONFIG, prefill=PoolLimits(min_groups=1, max_groups=6, ranks_per_group=2), rank_budget=14
    )
    scaler = Autoscaler(config)
    for _ in range(2):
        added = _tick(scaler, prefill=_measured(1, 10_000.0, backlog=300_000.0))[P]
    assert added.action == "add" and added.desired_groups == 3  # (10k + 10k) / 9k -> 3
    starting = _tick(scaler, prefill=_measured(1, 10_000.0, pending=2, backlog=300_000.0))[P]
    assert starting.action == "hold" and starting.rule == "pending"  # the plan is what is starting
    grown = _tick(scaler, prefill=_measured(1, 10_000.0, pending=2, backlog=900_000.0))[P]
    assert (grown.action, grown.rule) == ("add", "plan, more while starting")
    assert grown.desired_groups == 5 and grown.count == 2  # (10k + 30k) / 9k -> 5: two more


def test_a_measured_pool_drains_to_its_plan_after_a_calm_window() -> None:
    """Four groups carrying what one carries within the SLO: after downscale_ticks calm ticks
    the pool drains to the plan in one decision; a latency near the SLO holds it."""
    scaler = Autoscaler(CONFIG)
    quiet = _measured(3, 4000.0, ttft=0.25)
    decisions = [_tick(scaler, prefill=quiet)[P] for _ in range(CONFIG.downscale_ticks)]
    assert [d.action for d in decisions[:-1]] == ["hold"] * (CONFIG.downscale_ticks - 1)
    assert decisions[-2].rule == f"calm {CONFIG.downscale_ticks - 1}/{CONFIG.downscale_ticks}"
    assert decisions[-1].inputs["plan"]["groups"] == 1
    assert (decisions[-1].action, decisions[-1].rule, decisions[-1].count) == ("drain", "plan", 2)
    near = Autoscaler(CONFIG)
    for _ in range(CONFIG.downscale_ticks):
        held = _tick(near, prefill=_measured(3, 4000.0, ttft=0.9))[P]
    assert held.action == "hold" and "peaked within the margin" in held.rule


def test_the_plans_of_the_first_calm_ticks_count_in_the_drain() -> None:
    """Three groups carrying three groups' load for the first calm ticks, then one group's: the
    calm window's largest plan is still three, so nothing drains (one low tick is no trend). The
    forecast holds no peak here, so only the calm window remembers the first ticks' plans."""
    scaler = Autoscaler(CONFIG)
    scaler.planner = Planner(CONFIG, PlannerConfig(peak_window_s=0.0))
    busy = [_tick(scaler, prefill=_measured(3, 20_000.0, ttft=0.25))[P] for _ in range(3)]
    assert [d.inputs["plan"]["groups"] for d in busy] == [3, 3, 3]
    held = _tick(scaler, prefill=_measured(3, 4000.0, ttft=0.25))[P]
    assert held.action == "hold" and held.rule == "calm, the plan keeps 3 groups"


def test_an_slo_breach_the_plan_does_not_explain_still_adds_a_group() -> None:
    """One group is plenty by throughput, yet the TTFT observed is 1.5 s: the correction learns
    it, which puts a prompt's own predicted time past the SLO (no size the model knows meets
    it), so the plan stays; the breach itself adds a group."""
    scaler = Autoscaler(CONFIG)
    breach = _measured(2, 4000.0, ttft=1.5)
    assert _tick(scaler, prefill=breach)[P].rule == "slo 1/2"
    added = _tick(scaler, prefill=breach)[P]
    assert (added.action, added.rule, added.desired_groups) == ("add", "slo", 3)
    assert added.inputs["plan"]["groups"] <= 2
