"""The autoscaler's loop in the controller: it takes group states from the controller (not the
scrape), records every decision, carries out adds and drains one at a time, and in a dry run
decides and records without acting."""

from __future__ import annotations

from dataclasses import replace

from tandem.autoscaler.config import AutoscalingConfig
from tandem.autoscaler.policy import Autoscaler
from tandem.autoscaler.signals import MetricSource, PoolSignals
from tandem.cluster.autoscaling import AutoscalerLoop
from tandem.wire.messages import Role

SLOW_TTFT = {
    Role.PREFILL: PoolSignals(ready_groups=9, latency_p90_s=5.0),  # the scrape's group count lags
    Role.DECODE: PoolSignals(ready_groups=9, latency_p90_s=0.01),
}


class _Scripted(MetricSource):
    def read(self) -> dict[Role, PoolSignals]:
        return dict(SLOW_TTFT)


def _loop(dry_run: bool) -> tuple[AutoscalerLoop, list[str]]:
    actions: list[str] = []
    groups = {Role.PREFILL: 1, Role.DECODE: 1}

    def add(pool: Role) -> str:
        groups[pool] += 1
        actions.append(f"add {pool.value}")
        return f"{pool.value}{groups[pool] - 1}"

    loop = AutoscalerLoop(
        Autoscaler(replace(AutoscalingConfig(), upscale_ticks=2, settle_ticks=0)),
        _Scripted(),
        lambda pool: (groups[pool], 0),
        add,
        lambda pool: actions.append(f"drain {pool.value}") or "",  # type: ignore[func-returns-value]
        dry_run,
    )
    return loop, actions


def test_pressure_adds_a_group_with_the_controllers_group_count() -> None:
    loop, actions = _loop(dry_run=False)
    first = loop.tick()
    assert [d.action for d in first] == ["hold", "hold"] and first[0].ready_groups == 1  # not the scrape's 9
    second = loop.tick()
    assert second[0].action == "add" and actions == ["add prefill"]
    assert loop.desired == {"prefill": 2, "decode": 1}
    assert loop.counts[("prefill", "add", "slo")] == 1 and len(loop.decisions) == 4


def test_a_dry_run_decides_and_records_but_does_not_act() -> None:
    loop, actions = _loop(dry_run=True)
    loop.tick()
    decisions = loop.tick()
    assert decisions[0].action == "add" and actions == []
    assert loop.counts[("prefill", "add", "slo")] == 1
