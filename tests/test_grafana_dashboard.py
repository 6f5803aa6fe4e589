"""The Grafana dashboard in ``deploy/grafana/tandem.json``: it loads as a dashboard, and every metric
its queries name is one that some Tandem process exports, so a renamed metric breaks this test
instead of leaving an empty panel."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tandem.metrics.catalog import exported_metric_names

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "tandem.json"
METRIC_NAME = re.compile(r"\btandem_[a-z0-9_]+\b")

# One series per topic the dashboard must show
REQUIRED = (
    "tandem_cached_prompt_tokens_total",
    "tandem_new_prompt_tokens_total",
    "tandem_generation_tokens_total",
    "tandem_time_to_first_token_seconds_bucket",
    "tandem_inter_token_latency_seconds_bucket",
    "tandem_request_latency_part_seconds_sum",
    "tandem_kv_cache_usage_ratio",
    "tandem_kv_transfer_bytes_total",
    "tandem_kv_transfer_exposed_seconds_sum",
    "tandem_router_decisions_total",
    "tandem_group_state",
    "tandem_spec_acceptance_length_sum",
    "tandem_spec_accepted_tokens_total",
    "tandem_kv_tier_load_bytes_total",
    "tandem_kv_store_errors_total",
)


@pytest.fixture(scope="module")
def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD.read_text())


@pytest.fixture(scope="module")
def exported() -> set[str]:
    return set().union(*exported_metric_names().values())


def dashboard_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, rows' nested ``panels`` (a collapsed row's) included."""
    for panel in panels:
        yield panel
        yield from dashboard_panels(panel.get("panels", []))


def dashboard_queries(dashboard: dict[str, Any]) -> list[str]:
    """The PromQL of every panel target and every templating query."""
    out = [
        target["expr"]
        for panel in dashboard_panels(dashboard.get("panels", []))
        for target in panel.get("targets", [])
        if target.get("expr")
    ]
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable.get("type") != "query":
            continue
        query = variable.get("query")
        out.append(query.get("query", "") if isinstance(query, dict) else str(query or ""))
        out.append(str(variable.get("definition", "")))
    return [e for e in out if e]


def metric_names(exprs: list[str]) -> set[str]:
    return {name for expr in exprs for name in METRIC_NAME.findall(expr)}


def unknown_metrics(exprs: list[str], known: set[str]) -> set[str]:
    """The metric names in ``exprs`` that no process exports."""
    return metric_names(exprs) - known


def test_is_a_dashboard_with_unique_panel_ids(dashboard: dict[str, Any]) -> None:
    """The file is a Grafana dashboard model with panels, each with its own id."""
    assert dashboard.get("schemaVersion") == 39
    assert dashboard.get("title")
    panels = list(dashboard_panels(dashboard.get("panels", [])))
    assert any(p.get("type") != "row" for p in panels), "the dashboard has no panels"
    ids = [p.get("id") for p in panels]
    assert None not in ids, "a panel without an id"
    duplicates = sorted({i for i in ids if ids.count(i) > 1})
    assert not duplicates, f"panel ids used twice in {DASHBOARD}: {duplicates}"
    for panel in panels:
        if panel.get("type") != "row":
            assert panel.get("title") and panel.get("description"), f"panel {panel['id']} lacks a title"
            assert panel.get("targets"), f"panel {panel['id']} ({panel['title']}) has no query"


def test_has_a_prometheus_datasource_variable(dashboard: dict[str, Any]) -> None:
    """The queries go through a ``datasource`` variable of Prometheus type, so the dashboard imports
    into any Grafana."""
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    source = variables.get("datasource")
    assert source is not None and source["type"] == "datasource" and source["query"] == "prometheus"
    for panel in dashboard_panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", f"panel {panel['title']}"
    assert "tandem_requests_total" in variables["model"]["definition"]


def test_every_metric_the_dashboard_names_is_exported(dashboard: dict[str, Any], exported: set[str]) -> None:
    """A query naming a series no process exports (a typo, a renamed metric) fails here."""
    exprs = dashboard_queries(dashboard)
    assert exprs, "no query found"
    unknown = unknown_metrics(exprs, exported)
    assert not unknown, f"{DASHBOARD} names metrics no Tandem process exports: {sorted(unknown)}"


def test_dashboard_covers_the_required_topics(dashboard: dict[str, Any]) -> None:
    """Throughput, latency and its composition, KV cache and transfer, router and groups each have
    a panel."""
    named = metric_names(dashboard_queries(dashboard))
    missing = [name for name in REQUIRED if name not in named]
    assert not missing, f"{DASHBOARD} has no query on {missing}"


def test_checker_reports_a_bogus_metric(exported: set[str]) -> None:
    """The name check is not vacuous: it extracts names from PromQL and reports an unknown one."""
    assert "tandem_requests_total" in exported
    expr = (
        "sum(rate(tandem_no_such_metric_total[$__rate_interval]))"
        ' / sum(rate(tandem_requests_total{model=~"$model"}[$__rate_interval]))'
    )
    assert unknown_metrics([expr], exported) == {"tandem_no_such_metric_total"}
    bogus = {"panels": [{"type": "row", "id": 1, "panels": [{"id": 2, "targets": [{"expr": expr}]}]}]}
    assert unknown_metrics(dashboard_queries(bogus), exported) == {"tandem_no_such_metric_total"}
