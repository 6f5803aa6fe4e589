"""The controller's metrics: every group's state and incarnation, restarts, and the ranks that
take work in each pool; the autoscaler's decisions and its own failures. Read from the
controller's view when Prometheus scrapes."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.metrics.labels import ControllerLabels

GROUP_STATES = ("starting", "ready", "draining", "failed", "stopped")


@dataclass(frozen=True)
class GroupFigures:
    group_id: str
    role: str
    state: str
    incarnation: int
    restarts: int
    ranks: int
    unplaceable: bool = False  # its rebuild finds no room on the nodes of its role


@dataclass(frozen=True)
class AutoscalerFigures:
    desired_groups: dict[str, int]  # pool -> the groups the last decision wants
    decisions: dict[tuple[str, str, str], int]  # (pool, action, reason) -> decisions since start
    ticks: int = 0  # ticks completed
    tick_errors: int = 0  # ticks that raised
    thread_restarts: int = 0  # times its thread had died and was started again
    drain_timeouts: dict[str, int] = field(default_factory=dict)  # pool -> drains cancelled (any)
    action_failures: dict[tuple[str, str], int] = field(default_factory=dict)  # (pool, action) -> failed


class ControllerMetrics:
    def __init__(
        self,
        labels: ControllerLabels,
        groups: Callable[[], list[GroupFigures]],
        autoscaler: Callable[[], AutoscalerFigures | None] = lambda: None,
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_GroupsCollector(labels, groups))
        self.registry.register(_AutoscalerCollector(labels, autoscaler))


class _AutoscalerCollector(Collector):
    def __init__(self, labels: ControllerLabels, figures: Callable[[], AutoscalerFigures | None]) -> None:
        self.labels, self.figures = labels, figures

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        figures = self.figures()
        if figures is None:  # autoscaling is off
            return
        names, values = list(self.labels.as_dict()), list(self.labels.as_dict().values())
        desired = GaugeMetricFamily(
            "tandem_autoscaler_desired_groups",
            "Groups the autoscaler's last decision wants in each pool",
            labels=[*names, "pool"],
        )
        for pool, groups in sorted(figures.desired_groups.items()):
            desired.add_metric([*values, pool], groups)
        decisions = CounterMetricFamily(
            "tandem_autoscaler_decisions",
            "The autoscaler's decisions by pool, action and reason",
            labels=[*names, "pool", "action", "reason"],
        )
        for (pool, action, reason), count in sorted(figures.decisions.items()):
            decisions.add_metric([*values, pool, action, reason], count)
        yield desired
        yield decisions
        for name, doc, value in (
            ("tandem_autoscaler_ticks", "Ticks the autoscaler completed", figures.ticks),
            ("tandem_autoscaler_tick_errors", "Autoscaler ticks that raised (logged)", figures.tick_errors),
            (
                "tandem_autoscaler_thread_restarts",
                "Times the autoscaler's thread had died and was started again",
                figures.thread_restarts,
            ),
        ):
            counter = CounterMetricFamily(name, doc, labels=names)
            counter.add_metric(values, value)
            yield counter
        timeouts = CounterMetricFamily(
            "tandem_autoscaler_drain_timeouts",
            "Drains cancelled at their timeout, the autoscaler's or remove_group's (the group took "
            "work again), by pool",
            labels=[*names, "pool"],
        )
        for pool, count in sorted(figures.drain_timeouts.items()):
            timeouts.add_metric([*values, pool], count)
        failures = CounterMetricFamily(
            "tandem_autoscaler_action_failures",
            "Autoscaler adds and drains that raised (logged), by pool and action",
            labels=[*names, "pool", "action"],
        )
        for (pool, action), count in sorted(figures.action_failures.items()):
            failures.add_metric([*values, pool, action], count)
        yield timeouts
        yield failures


class _GroupsCollector(Collector):
    def __init__(self, labels: ControllerLabels, groups: Callable[[], list[GroupFigures]]) -> None:
        self.labels, self.groups = labels, groups

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        names, values = list(self.labels.as_dict()), list(self.labels.as_dict().values())
        state = GaugeMetricFamily(
            "tandem_group_state",
            "1 for each group's current state, 0 for the others",
            labels=[*names, "group", "role", "state"],
        )
        incarnation = GaugeMetricFamily(
            "tandem_group_incarnation",
            "Each group's incarnation (starts count)",
            labels=[*names, "group", "role"],
        )
        restarts = CounterMetricFamily(
            "tandem_group_restarts",
            "Rebuilds of each group after a failure",
            labels=[*names, "group", "role"],
        )
        unplaceable = GaugeMetricFamily(
            "tandem_group_unplaceable",
            "1 while a group's rebuild finds no room on the nodes of its role (a lost node), else 0",
            labels=[*names, "group", "role"],
        )
        pool: dict[str, int] = {}
        for g in self.groups():
            unplaceable.add_metric([*values, g.group_id, g.role], 1.0 if g.unplaceable else 0.0)
            for s in GROUP_STATES:
                state.add_metric([*values, g.group_id, g.role, s], 1.0 if g.state == s else 0.0)
            incarnation.add_metric([*values, g.group_id, g.role], g.incarnation)
            restarts.add_metric([*values, g.group_id, g.role], g.restarts)
            pool[g.role] = pool.get(g.role, 0) + (g.ranks if g.state == "ready" else 0)
        ranks = GaugeMetricFamily(
            "tandem_pool_ranks", "Ranks that take work, by pool", labels=[*names, "role"]
        )
        for role in ("prefill", "decode"):
            ranks.add_metric([*values, role], pool.get(role, 0))
        yield from (state, incarnation, restarts, unplaceable, ranks)
