"""The planner against scripted loads: capacity is learned from the windows' figures, the planned
size follows demand over measured capacity, a doubled load is planned for on the tick it shows,
an idle pool plans its minimum, a tight TTFT SLO asks for more than throughput does, and decode
sizes from its fitted latency and its KV."""

from __future__ import annotations

import math
import random
import re
from dataclasses import replace

import pytest

from tandem.autoscaler.capacity import DecodeCapacity, PrefillCapacity, bucket_of, mmn_wait_quantile_s
from tandem.autoscaler.config import AutoscalingConfig, PoolLimits
from tandem.autoscaler.forecast import BurstHeadroom, TrendForecast
from tandem.autoscaler.planner import Planner, PlannerConfig
from tandem.autoscaler.signals import PoolSignals
from tandem.wire.messages import Role

P, D = Role.PREFILL, Role.DECODE
CONFIG = AutoscalingConfig(
    prefill=PoolLimits(min_groups=1, max_groups=8, ranks_per_group=4),
    decode=PoolLimits(min_groups=1, max_groups=8, ranks_per_group=2),
    rank_budget=48,
    ttft_slo_s=2.0,
    itl_slo_s=0.1,
    interval_s=5.0,
)
GROUP_RATE = 10_000.0  # tokens per busy group-second of the scripted prefill pool
PROMPT = 4000.0


def _prefill(demand: float, groups: int, *, backlog: float = 0.0, ttft: float | None = None) -> PoolSignals:
    """A window of the scripted pool: its groups are busy demand / GROUP_RATE of the time."""
    busy = min(groups, demand / GROUP_RATE)
    return PoolSignals(
        ready_groups=groups,
        latency_p90_s=ttft,
        demand=demand,
        busy_groups=busy,
        backlog=backlog,
        prompt_tokens=PROMPT if demand else None,
    )


def test_prefill_capacity_is_the_tokens_per_busy_group_second_by_prompt_bucket() -> None:
    cap = PrefillCapacity()
    assert cap.per_group(PROMPT) is None  # unmeasured: no guess
    for _ in range(20):
        cap.observe(5000.0, 0.5, PROMPT)  # half a group busy for 5k tok/s: 10k per busy group
        cap.observe(3000.0, 1.0, 16_000.0)  # long prompts run slower (attention)
    assert cap.per_group(PROMPT) == pytest.approx(10_000.0)
    assert cap.per_group(16_000.0) == pytest.approx(3000.0)
    assert cap.per_group(3000.0) == pytest.approx(10_000.0)  # the same log2 bucket as 4000
    assert bucket_of(PROMPT) != bucket_of(16_000.0)
    cap.observe(100.0, 0.01, PROMPT)  # a barely busy window says little: ignored
    assert cap.per_group(PROMPT) == pytest.approx(10_000.0)


def test_the_mmn_waits_p90_grows_with_load_and_is_unbounded_at_saturation() -> None:
    """Rising with load from 0 (a light load waits less than 1 time in 10), infinite at
    saturation, shorter with more servers; on one server it is M/M/1's exact p90:
    P(W > t) = rho exp(-(1 - rho) t / service), so t = service / (1 - rho) ln(10 rho)."""
    waits = [mmn_wait_quantile_s(rate, 0.4, 2) for rate in (0.5, 2.5, 4.5, 4.99)]
    assert waits[0] == 0.0 and waits[1] < waits[2] < waits[3]
    assert mmn_wait_quantile_s(5.0, 0.4, 2) == math.inf and mmn_wait_quantile_s(0.0, 0.4, 2) == 0.0
    assert mmn_wait_quantile_s(4.0, 0.4, 4) < mmn_wait_quantile_s(4.0, 0.4, 2)  # more servers, less wait
    assert mmn_wait_quantile_s(0.8, 1.0, 1) == pytest.approx(1.0 / 0.2 * math.log(8.0))


def test_the_ttft_correction_follows_observed_over_predicted_within_its_bounds() -> None:
    cap = PrefillCapacity()
    for _ in range(10):
        cap.observe(5000.0, 0.5, PROMPT)
    raw = cap.raw_ttft_s(5000.0, PROMPT, 1)
    assert raw is not None and raw > PROMPT / GROUP_RATE
    for _ in range(30):
        cap.correct(2 * raw, 5000.0, PROMPT, 1)
    assert cap.k == pytest.approx(2.0, rel=0.01)
    assert cap.predict_ttft_s(5000.0, PROMPT, 1) == pytest.approx(2 * raw, rel=0.01)
    for _ in range(30):
        cap.correct(1000 * raw, 5000.0, PROMPT, 1)
    assert 7.99 < cap.k <= 8.0  # clamped: one odd window cannot swing it far


def test_the_planned_prefill_size_follows_demand_over_measured_capacity() -> None:
    planner = Planner(CONFIG, PlannerConfig(peak_window_s=0, growth_history_s=0))
    plans = []  # each level lasts longer than the trend's ticks
    for tick, demand in enumerate([20_000.0] * 14 + [40_000.0] * 14 + [60_000.0] * 14):
        plans.append(planner.plan(P, _prefill(demand, 8), tick * 5.0))
    steady = [plans[13], plans[27], plans[41]]
    assert all(p is not None for p in steady)
    for plan, demand in zip(steady, (20_000.0, 40_000.0, 60_000.0), strict=True):
        assert plan is not None
        assert plan.capacity_per_group == pytest.approx(GROUP_RATE)
        assert plan.needed == pytest.approx(demand / (GROUP_RATE * 0.9), rel=1e-3)
        assert plan.groups == math.ceil(demand / (GROUP_RATE * 0.9))
    # a backlog asks for the groups that drain it within backlog_drain_s besides
    backed = planner.plan(P, _prefill(60_000.0, 8, backlog=300_000.0), 42 * 5.0)
    assert backed is not None and backed.needed == pytest.approx((60_000 + 10_000) / 9000, rel=1e-3)


def test_a_doubled_load_is_planned_for_on_the_tick_it_shows() -> None:
    planner = Planner(CONFIG)
    for tick in range(24):
        plan = planner.plan(P, _prefill(14_000.0, 3), tick * 5.0)
    assert plan is not None and (plan.groups, plan.basis) == (2, "throughput")
    doubled = planner.plan(P, _prefill(28_000.0, 3), 24 * 5.0)
    assert doubled is not None and doubled.groups >= math.ceil(28_000 / 9000)
    assert doubled.demand_ahead >= 28_000.0


def test_an_idle_pool_plans_its_minimum_once_its_peak_window_passed() -> None:
    planner = Planner(CONFIG, PlannerConfig(peak_window_s=60, growth_history_s=0))
    for tick in range(12):
        planner.plan(P, _prefill(50_000.0, 6), tick * 5.0)
    idle = [planner.plan(P, _prefill(0.0, 6), 60 + tick * 5.0) for tick in range(30)]
    assert all(p is not None for p in idle)
    assert idle[0] is not None and idle[0].groups > 1  # the recent peak is still in view
    assert idle[-1] is not None and (idle[-1].groups, idle[-1].basis) == (1, "min_groups")


def test_a_tight_ttft_slo_plans_more_groups_than_throughput_needs() -> None:
    """25k tokens/s of 4k-token prompts at 10k per group: three groups carry it (a p90 TTFT of
    0.4 s of compute plus 1.6 s of waiting, within a 4 s SLO); a 0.6 s SLO needs more."""
    tight = AutoscalingConfig(
        prefill=CONFIG.prefill, decode=CONFIG.decode, rank_budget=48, ttft_slo_s=0.6, interval_s=5.0
    )
    roomy = AutoscalingConfig(
        prefill=CONFIG.prefill, decode=CONFIG.decode, rank_budget=48, ttft_slo_s=4.0, interval_s=5.0
    )
    loose = Planner(roomy, PlannerConfig(peak_window_s=0, growth_history_s=0))
    strict = Planner(tight, PlannerConfig(peak_window_s=0, growth_history_s=0))
    for tick in range(10):
        a = loose.plan(P, _prefill(25_000.0, 8), tick * 5.0)
        b = strict.plan(P, _prefill(25_000.0, 8), tick * 5.0)
    assert a is not None and b is not None
    assert (a.groups, a.basis) == (3, "throughput")
    assert b.groups > a.groups and b.basis == "ttft"
    assert b.predicted_planned_s is not None and b.predicted_planned_s <= 0.6 * 0.8
    assert a.predicted_planned_s is not None and a.predicted_planned_s > b.predicted_planned_s


def test_an_slo_below_a_prompts_own_compute_time_asks_for_no_group_that_cannot_help() -> None:
    """4k-token prompts take 0.4 s on one group whatever the pool's size: at a light load (no
    queue to shorten) a 50 ms TTFT SLO plans the throughput's size, not every group allowed."""
    unreachable = AutoscalingConfig(
        prefill=CONFIG.prefill, decode=CONFIG.decode, rank_budget=48, ttft_slo_s=0.05, interval_s=5.0
    )
    planner = Planner(unreachable, PlannerConfig(peak_window_s=0, growth_history_s=0))
    for tick in range(10):
        plan = planner.plan(P, _prefill(2_000.0, 4), tick * 5.0)
    assert plan is not None and (plan.groups, plan.basis) == (1, "throughput")
    for tick in range(10, 20):  # idle: no prompt in the window, the last bucket's figures
        idle = planner.plan(P, _prefill(0.0, 4), tick * 5.0)
    assert idle is not None and idle.groups == 1


def test_decode_latency_is_fitted_and_bounds_the_sequences_per_group() -> None:
    cap = DecodeCapacity()
    assert cap.fit() is None
    for n in (4, 8, 16, 32):
        for ctx in (1000.0, 4000.0):
            cap.observe(n, ctx, 0.012 + 0.0003 * n + 2e-7 * n * ctx)
    fitted = cap.fit()
    assert fitted is not None
    assert fitted == pytest.approx((0.012, 0.0003, 2e-7), rel=1e-6)
    most = cap.seqs_per_group(0.08, 1000.0)
    assert most == pytest.approx((0.08 - 0.012) / (0.0003 + 2e-7 * 1000))
    cap.kv_tokens_per_group = 50_000.0
    assert cap.seqs_per_group(0.08, 1000.0) == pytest.approx(50.0)  # the KV holds fewer


def test_the_planned_decode_size_is_the_forecast_sequences_over_one_groups_share() -> None:
    planner = Planner(CONFIG, PlannerConfig(peak_window_s=0, growth_history_s=0))
    plan = None
    for tick, n in enumerate([8, 16, 24, 32, 40, 48, 48, 48, 48, 48, 48, 48, 48, 48, 48, 48]):
        itl = 0.012 + 0.0003 * (n / 2) + 2e-7 * (n / 2) * 2000
        signals = PoolSignals(ready_groups=2, latency_p90_s=itl, demand=float(n), context_tokens=2000.0)
        plan = planner.plan(D, signals, tick * 5.0)
    assert plan is not None and plan.basis == "sequences"
    per_group = (0.1 * 0.8 - 0.012) / (0.0003 + 2e-7 * 2000)
    assert plan.capacity_per_group == pytest.approx(per_group, rel=1e-6)
    assert plan.groups == math.ceil(48 / per_group)


def test_the_forecast_extrapolates_a_ramp_and_holds_a_recent_peak() -> None:
    ramp = TrendForecast(trend_ticks=6, peak_window_s=0, rise_history_s=0)
    for t in range(10):
        ramp.observe(t * 5.0, 1000.0 + 100.0 * t)
    assert ramp.predict(50.0) == pytest.approx(1900.0 + 1000.0)
    peak = TrendForecast(trend_ticks=3, peak_window_s=30, rise_history_s=0)
    for t, v in enumerate([100.0, 900.0, 100.0, 100.0, 100.0]):
        peak.observe(t * 5.0, v)
    assert peak.predict(10.0) == pytest.approx(900.0)
    rises = TrendForecast(
        trend_ticks=2, peak_window_s=0, rise_history_s=600, rise_quantile=1.0, rise_smoothing_ticks=1
    )
    for t, v in enumerate([100.0, 100.0, 500.0, 500.0, 100.0, 100.0, 100.0]):
        rises.observe(t * 5.0, v)
    # it has risen from 100 by 400 in 5 s before, counted as at most max_rise (3) times 100
    assert rises.predict(5.0) == pytest.approx(100.0 + 300.0)
    # a pool idle now plans for no load, however fast it rose before (no rise from zero either)
    for t, v in enumerate([0.0, 0.0, 0.0], start=7):
        rises.observe(t * 5.0, v)
    assert rises.predict(5.0) == 0.0
    with pytest.raises(ValueError, match=r"t_s: 1\.0 is not after"):
        rises.observe(1.0, 0.0)


def test_the_burst_headroom_is_the_historys_peak_to_level_ratio_at_the_current_level() -> None:
    """Arrivals at 100 tokens a second whose every fourth window peaked at 300 over 15 s: the
    ratios' top is 3 (the level, the last 4 windows' mean, is 100); at half the level the
    headroom halves with it; a window without arrivals lowers the level, and a peak not read
    adds no ratio."""
    headroom = BurstHeadroom(level_ticks=4, quantile=1.0)
    assert headroom.peak() is None
    for t in range(40):
        headroom.observe(t * 5.0, 100.0, 300.0 if t % 4 == 3 else 110.0)
    assert headroom.peak() == pytest.approx(300.0)
    for t in range(40, 44):
        headroom.observe(t * 5.0, 50.0, 60.0)
    assert headroom.peak() == pytest.approx(50.0 * 3.0)  # the history's ratio, at today's level
    ratios = len(headroom.ratios)
    headroom.observe(220.0, None, math.nan)
    assert len(headroom.ratios) == ratios and headroom.peak() == pytest.approx(37.5 * 3.0)
    with pytest.raises(ValueError, match="level_ticks: must be an integer >= 1"):
        BurstHeadroom(level_ticks=0)


def test_bursts_shorter_than_a_start_keep_the_groups_that_absorb_them() -> None:
    """20k tokens/s on average, and in every sixth window 15 s at 60k: the throughput alone
    asks for 3 groups (20k / 9k), but the bursts need n * 10k >= 60k * 15 / (15 + 1.6 - 0.4)
    (their backlog cleared within the SLO's room past a prompt's compute): 6 groups; without
    the burst reading, the throughput's 3."""
    plans = {}
    for quantile in (0.9, None):
        planner = Planner(CONFIG, PlannerConfig(burst_quantile=quantile))
        for tick in range(60):
            peak = 60_000.0 if tick % 6 == 5 else 22_000.0
            signals = replace(_prefill(20_000.0, 6), arrival_rate=20_000.0, demand_peak=peak)
            plans[quantile] = planner.plan(P, signals, tick * 5.0)
    burst, plain = plans[0.9], plans[None]
    assert burst is not None and plain is not None
    assert (plain.groups, plain.basis) == (3, "throughput")
    assert burst.basis == "burst"
    expected = 60_000 * 15 / (15 + 2.0 * 0.8 - PROMPT / GROUP_RATE) / GROUP_RATE
    assert burst.needed == pytest.approx(expected, rel=1e-4)
    assert burst.groups == 6


def test_an_idle_pool_after_an_uneven_burst_forecasts_exactly_no_load() -> None:
    """Uneven figures, then an idle minute: the smoothed level is exactly 0 (a running sum's
    rounding residue read it as busy, and the history's rises, 10^5 tokens/s, were added to it)."""
    rng = random.Random(7)
    forecast = TrendForecast(peak_window_s=30)
    values = [rng.uniform(1_000.0, 90_000.0) for _ in range(60)] + [0.0] * 12
    for t, v in enumerate(values):
        forecast.observe(t * 5.0, v)
    assert forecast._smoothed()[-1][1] == 0.0
    assert forecast.predict(90.0) == 0.0


def test_infinite_or_nan_figures_are_ignored_not_learned() -> None:
    """A ratio over an empty rate is +Inf or NaN in PromQL; the planner neither learns from it
    nor fails on it."""
    planner = Planner(CONFIG)
    for tick in range(5):
        planner.plan(P, _prefill(20_000.0, 4), tick * 5.0)
    odd = PoolSignals(
        ready_groups=4, latency_p90_s=math.inf, demand=math.nan, busy_groups=1.0, prompt_tokens=math.inf
    )
    plan = planner.plan(P, odd, 25.0)
    assert plan is not None and plan.capacity_per_group == pytest.approx(GROUP_RATE)
    decode = PoolSignals(ready_groups=1, latency_p90_s=math.inf, demand=4.0, context_tokens=math.nan)
    assert planner.plan(D, decode, 25.0) is None and not planner.decode.samples


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"utilization_target": 0}, "utilization_target: must be in (0, 1]"),
        ({"backlog_drain_s": 0}, "backlog_drain_s: must be a positive number of seconds"),
        ({"group_start_s": -1}, "group_start_s: must be a number of seconds >= 0"),
        ({"forecast_ticks": 1}, "trend_ticks: must be an integer >= 2"),
        ({"burst_window_s": 0}, "burst_window_s: must be a positive number of seconds"),
        ({"burst_quantile": 1.5}, "burst_quantile: must be in [0, 1]"),
    ],
)
def test_a_bad_planner_setting_names_its_field(change: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        Planner(CONFIG, PlannerConfig(**change))  # type: ignore[arg-type]
