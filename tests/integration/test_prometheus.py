"""A real Prometheus scrapes a served deployment through its discovery document: every process's
target is up, the counters equal the sums of the bills the client received, the request count
by finish reason is exact, the TTFT histogram agrees with the bills' TTFTs, and a decode group
killed and rebuilt shows up with its new incarnation.

Also here, on the same workload: the parts of each bill's latency composition add up to its
end-to-end time, short only by the flights between processes.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import statistics
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import ray

from tandem.autoscaler.prometheus_source import PrometheusSource
from tandem.client.grpc_client import ClientOptions, generate_all
from tandem.client.prompts import PromptSpec
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import PoolSpec, Topology
from tandem.metrics.discovery import prometheus_config
from tandem.metrics.frontend import TTFT_BUCKETS
from tandem.protos import tandem_pb2
from tandem.wire.messages import Role
from tandem.wire.request_params import SamplingParams
from tests.integration.prometheus_server import Prometheus, prometheus_server
from tests.test_grafana_dashboard import DASHBOARD, dashboard_panels

PAGE = 16
SHARED = [random.Random(7).randrange(256) for _ in range(3 * PAGE)]  # three pages every prompt shares


@dataclass
class Deployment:
    server: Server
    prometheus: Prometheus
    grpc_addr: str


@pytest.fixture(scope="module")
def deployment(tiny_dir: Path) -> Iterator[Deployment]:
    pool = PoolSpec(dep=2, page_size=PAGE, num_pages=64)
    topology = Topology.preset("local").model_copy(update={"prefill": pool, "decode": pool})
    server = Server(ServeOptions(topology, tiny_dir, port=0, dtype="float64", metrics_port=0))
    try:
        server.start()
        assert server.metrics_address is not None
        config = prometheus_config(server.metrics_address, scrape_interval_s=0.5, refresh_s=0.5)
        with prometheus_server(config) as prometheus:
            yield Deployment(server, prometheus, f"127.0.0.1:{server.port}")
    finally:
        server.stop()
        ray.shutdown()


def _prompts(n: int, seed: int) -> list[PromptSpec]:
    rng = random.Random(seed)
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    return [PromptSpec(None, SHARED + [rng.randrange(256) for _ in range(5 + i)], sampling) for i in range(n)]


def _summaries(addr: str, specs: list[PromptSpec], concurrency: int) -> list[tandem_pb2.Summary]:
    outcomes = asyncio.run(generate_all(ClientOptions(addr), specs, concurrency))
    summaries = [o.summary for o in outcomes]
    assert all(s is not None and not s.error for s in summaries), summaries
    return [s for s in summaries if s is not None]


def _p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[math.ceil(0.9 * len(ordered)) - 1]


def _bucket(value: float) -> int:
    return next((i for i, bound in enumerate(TTFT_BUCKETS) if value <= bound), len(TTFT_BUCKETS))


def test_prometheus_scrapes_every_process_and_the_counters_equal_the_bills(deployment: Deployment) -> None:
    prom = deployment.prometheus
    # the discovery document lists the frontend, the controller and the four ranks: all up
    deadline = time.monotonic() + 60
    while True:
        targets = prom.targets()
        if (len(targets) == 6 and all(t["health"] == "up" for t in targets)) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    kinds = sorted(t["labels"]["tandem_process"] for t in targets)
    assert kinds == ["controller", "frontend", "rank", "rank", "rank", "rank"], targets
    assert all(t["health"] == "up" for t in targets), [(t["scrapeUrl"], t["lastError"]) for t in targets]

    summaries = _summaries(deployment.grpc_addr, _prompts(1, 0), 1)  # its prefix pages get cached
    summaries += _summaries(deployment.grpc_addr, _prompts(7, 1), 4)
    bad = PromptSpec(None, [10**6], SamplingParams(max_tokens=2))  # outside the vocabulary
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        asyncio.run(generate_all(ClientOptions(deployment.grpc_addr), [bad], 1))
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT

    bills = [s.bill for s in summaries]
    assert sum(b.cached_tokens for b in bills) >= 7 * 3 * PAGE  # the later prompts hit the cache
    prom.wait_for('sum(tandem_requests_total{finish_reason="length", code="OK"})', len(summaries))
    prom.wait_for('sum(tandem_requests_total{finish_reason="rejected", code="INVALID_ARGUMENT"})', 1)
    assert prom.scalar("sum(tandem_requests_total)") == len(summaries) + 1
    for metric, total in (
        ("tandem_prompt_tokens_total", sum(b.prompt_tokens for b in bills)),
        ("tandem_cached_prompt_tokens_total", sum(b.cached_tokens for b in bills)),
        ("tandem_new_prompt_tokens_total", sum(b.new_prompt_tokens for b in bills)),
        ("tandem_generation_tokens_total", sum(b.output_tokens for b in bills)),
    ):
        assert prom.scalar(f"sum({metric})") == total, metric
    # the ranks' own counters agree with the bills: bytes the senders' descriptors covered
    attempts = sum(len(b.attempts) for b in bills)
    prom.wait_for('sum(tandem_kv_transfer_bytes_total{direction="send"})', sum(b.kv_bytes for b in bills))
    prom.wait_for('sum(tandem_kv_transfer_bytes_total{direction="recv"})', sum(b.kv_bytes for b in bills))
    prom.wait_for('sum(tandem_kv_transfer_seconds_count{role="prefill"})', attempts)
    prom.wait_for('sum(tandem_kv_transfer_exposed_seconds_count{role="decode"})', attempts)
    # TTFT: one observation per request, and Prometheus' p90 within one bucket of the bills'
    assert prom.scalar("sum(tandem_time_to_first_token_seconds_count)") == len(summaries)
    p90 = prom.scalar("histogram_quantile(0.9, sum by (le) (tandem_time_to_first_token_seconds_bucket))")
    assert p90 is not None
    bills_p90 = _p90([b.latency.ttft_s for b in bills])
    assert abs(_bucket(p90) - _bucket(bills_p90)) <= 1, (p90, bills_p90)
    assert prom.scalar("sum(tandem_router_decisions_total)") == len(summaries)
    assert prom.scalar('sum(tandem_pool_ranks{role="decode"})') == 2
    assert prom.scalar('sum(tandem_group_state{group="decode0", state="ready"})') == 1


def test_the_latency_composition_adds_up_to_end_to_end(deployment: Deployment) -> None:
    """queue + routing (frontend) + pickup + reservation wait + KV wait + accept + decode (decode
    rank) never exceeds end-to-end, and falls short of it by the flights between the processes:
    for the median request at most 50 ms plus 20% of end-to-end (one request alone can be held
    up by this shared machine; a part missing from the sum shows in every request)."""
    shortfalls = []
    for summary in _summaries(deployment.grpc_addr, _prompts(6, 2), 3):
        lat = summary.bill.latency
        parts = (
            lat.queue_s + lat.routing_s + lat.pickup_s + lat.reservation_wait_s + lat.kv_wait_s
            + lat.kv_accept_s + lat.decode_s
        )  # fmt: skip
        assert parts <= lat.e2e_s + 1e-3, lat
        shortfalls.append((lat.e2e_s - parts) - (0.05 + 0.2 * lat.e2e_s))
        assert lat.rank_s <= lat.e2e_s and lat.kv_wait_s > 0 and lat.decode_s > 0
        # inside the KV wait, each attempt's prefill figures come from its prefill rank
        for attempt in summary.bill.attempts:
            inside = attempt.prefill_queue_s + attempt.prefill_compute_s + attempt.kv_transfer_exposed_s
            assert 0 < inside <= attempt.kv_wait_s + 1e-3, attempt
    assert statistics.median(shortfalls) <= 0, shortfalls


def test_every_dashboard_query_runs_on_prometheus(deployment: Deployment) -> None:
    """Each panel's PromQL of ``deploy/grafana/tandem.json``, with the dashboard's variables
    set to match everything, is a valid query on a Prometheus scraping Tandem, and the panels
    have data to show after the workload above."""
    dashboard = json.loads(DASHBOARD.read_text())
    panel_queries = [
        target["expr"]
        for panel in dashboard_panels(dashboard["panels"])
        for target in panel.get("targets", [])
        if target.get("expr")
    ]
    assert panel_queries
    empty = []
    for expr in panel_queries:
        promql = expr.replace("$__rate_interval", "1m")
        for variable in ("$model", "$role", "$group", "$rank"):
            promql = promql.replace(variable, ".+")
        if not deployment.prometheus.query(promql):  # raises on a query Prometheus refuses
            empty.append(expr)
    assert len(empty) <= len(panel_queries) // 4, f"{len(empty)} queries without data: {empty}"


def test_the_autoscaler_reads_its_signals_from_prometheus(deployment: Deployment) -> None:
    """The autoscaler's default PromQL over this deployment: one ready group a pool, none
    pending, and the latency, queue and demand of the workload above."""
    source = PrometheusSource(deployment.prometheus.url, deployment.server.model_name, window="5m")
    # a scrape after the requests above ended (the last one may have seen them running)
    deployment.prometheus.wait_for('sum(tandem_num_requests_running{role="decode"})', 0)
    deployment.prometheus.wait_for('max(tandem_kv_cache_usage_ratio{role="decode"})', 0)
    # each target is scraped on its own phase: the prefill rank's last scrape may predate the end
    for role in ("prefill", "decode"):
        deployment.prometheus.wait_for(f'sum(tandem_num_requests_waiting{{role="{role}"}})', 0)
    signals = source.read()
    prefill, decode = signals[Role.PREFILL], signals[Role.DECODE]
    assert (prefill.ready_groups, prefill.pending_groups) == (1, 0)
    assert (decode.ready_groups, decode.pending_groups) == (1, 0)
    assert prefill.latency_p90_s is not None and 0 < prefill.latency_p90_s < 60
    assert decode.latency_p90_s is not None and 0 < decode.latency_p90_s < 60
    assert prefill.queue_s is not None and decode.queue_s is not None
    assert prefill.demand is not None and prefill.demand > 0  # new prompt tokens a second
    # the planner's: the one group was busy part of the window; the prompts' mean new tokens
    assert prefill.busy_groups is not None and 0 < prefill.busy_groups <= 1
    assert prefill.prompt_tokens is not None and prefill.prompt_tokens > 0
    assert prefill.backlog == 0 and decode.backlog == 0  # nothing waits
    assert decode.kv_usage == 0 and decode.demand == 0  # every request has ended
    source.queries = {**source.queries, "decode_kv_usage": "max(no_such_metric)"}
    assert source.query("decode_kv_usage") is None  # no sample: no figure, not zero


def test_the_planners_arrival_peak_reads_a_fresh_burst(deployment: Deployment) -> None:
    """A burst of requests routed now, once scraped: the peak 15 s rate of the new prompt tokens
    routed is above the window's mean rate of them (the arrival level), and both see them."""
    source = PrometheusSource(deployment.prometheus.url, deployment.server.model_name, window="5m")
    model = deployment.server.model_name
    routed = f'sum(tandem_router_new_prompt_tokens_total{{model="{model}"}})'
    before = deployment.prometheus.scalar(routed) or 0.0
    _summaries(deployment.grpc_addr, _prompts(6, 3), 3)
    deadline = time.monotonic() + 60.0
    while (deployment.prometheus.scalar(routed) or 0.0) <= before and time.monotonic() < deadline:
        time.sleep(0.25)  # until a scrape after the burst
    peak = rate = None
    while time.monotonic() < deadline:
        peak, rate = source.query("prefill_demand_peak"), source.query("prefill_arrival_rate")
        if peak is not None and rate is not None and peak > rate > 0:
            break
        time.sleep(0.5)
    assert peak is not None and rate is not None and peak > rate > 0, (peak, rate)


def test_a_rebuilt_decode_group_is_discovered_and_scraped(deployment: Deployment) -> None:
    server, prom = deployment.server, deployment.prometheus
    view = ray.get(server.controller.routing_view.remote())
    victim = next(handle for rank, handle in view.decode.items() if rank.group_id == "decode0")
    ray.kill(victim)
    deadline = time.monotonic() + 240
    while True:  # the watch fails the group and rebuilds it as incarnation 2
        view = ray.get(server.controller.routing_view.remote())
        group = next(g for g in view.groups if g.group_id == "decode0")
        if group.state == "ready" and group.incarnation == 2:
            break
        assert time.monotonic() < deadline, group
        time.sleep(1)
    while True:  # the frontend's discovery document follows the controller's view
        with urllib.request.urlopen(f"http://{server.metrics_address}/sd", timeout=10) as reply:
            document = json.load(reply)
        decode = [d["labels"] for d in document if d["labels"].get("group") == "decode0"]
        if [d["incarnation"] for d in decode] == ["2", "2"]:
            break
        assert time.monotonic() < deadline, document
        time.sleep(0.2)
    prom.wait_for('count(up{group="decode0", incarnation="2"} == 1)', 2, timeout_s=60)
    prom.wait_for('count(tandem_kv_cache_usage_ratio{group="decode0", incarnation="2"})', 2, timeout_s=60)
    prom.wait_for('sum(tandem_group_restarts_total{group="decode0"})', 1, timeout_s=60)
    # and the rebuilt group serves again
    assert len(_summaries(deployment.grpc_addr, _prompts(2, 3), 2)) == 2


def _frontend_generation_tokens(metrics_address: str) -> float:
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=10) as reply:
        for line in reply.read().decode().splitlines():
            if line.startswith("tandem_generation_tokens_total{"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("tandem_generation_tokens_total is not exported")


def test_observing_can_be_switched_off_and_on(deployment: Deployment) -> None:
    """What ``tandem bench metrics`` compares: with observing off, requests leave no count."""
    server = deployment.server
    before = _frontend_generation_tokens(str(server.metrics_address))
    server.observe(False)
    try:
        _summaries(deployment.grpc_addr, _prompts(1, 4), 1)
        assert _frontend_generation_tokens(str(server.metrics_address)) == before
    finally:
        server.observe(True)
    _summaries(deployment.grpc_addr, _prompts(1, 5), 1)
    assert _frontend_generation_tokens(str(server.metrics_address)) == before + 4
