"""Every metric Tandem exports, by the process kind that exports it: what the dashboard and the
metrics reference (``metrics/reference.py``) may name. Built from the real registries, filled
with one of each event."""

from __future__ import annotations

import functools

from prometheus_client import CollectorRegistry

from tandem.metrics.controller import AutoscalerFigures, ControllerMetrics, GroupFigures
from tandem.metrics.frontend import FrontendMetrics
from tandem.metrics.labels import ControllerLabels, FrontendLabels, RankLabels
from tandem.metrics.rank import RankMetrics
from tandem.wire.messages import RankId, RankStats, Role


def _same(stats: RankStats) -> RankStats:
    return stats


_SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def sample_names(registry: CollectorRegistry) -> set[str]:
    """The names of the series a scrape of ``registry`` can hold (``_total``, ``_bucket``, ...)."""
    out: set[str] = set()
    for family in registry.collect():
        out |= {family.name + suffix for suffix in _SUFFIXES.get(family.type, ("",))}
    return out


def exported_registries() -> dict[str, list[CollectorRegistry]]:
    """Each process kind's registries (``frontend``, ``rank``: a prefill and a decode rank,
    ``controller``), filled with one of each event."""
    frontend = FrontendMetrics(FrontendLabels("m", "f"), streams_open=lambda: 0)
    ranks = []
    for role in (Role.PREFILL, Role.DECODE):
        rank = RankMetrics(RankLabels("m", role.value, "g", "g-r0", "1"))
        stats = RankStats(RankId("g", 0), role, 1, transfer_failures=(("recv", "timeout", 1),))
        rank.watch(functools.partial(_same, stats))
        ranks.append(rank.registry)
    group = GroupFigures("g", "decode", "ready", 1, 0, 2)
    autoscaler = AutoscalerFigures({"decode": 2}, {("decode", "add", "slo"): 1})
    controller = ControllerMetrics(ControllerLabels("m"), lambda: [group], lambda: autoscaler)
    return {"frontend": [frontend.registry], "rank": ranks, "controller": [controller.registry]}


def exported_metric_names() -> dict[str, set[str]]:
    """Sample names by process kind: ``frontend``, ``rank`` (prefill and decode) and ``controller``."""
    return {
        kind: set().union(*(sample_names(registry) for registry in registries))
        for kind, registries in exported_registries().items()
    }
