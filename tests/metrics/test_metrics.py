"""Each process's metrics from known events: a request's summary becomes exactly its bill's
counts and one observation per histogram; a rank's figures come from its stats at scrape; the
HTTP endpoint serves them and the discovery document; the scrape configuration points at it."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from dataclasses import replace

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from tandem.cli.main import main
from tandem.metrics.controller import ControllerMetrics, GroupFigures
from tandem.metrics.discovery import prometheus_config, sd_document
from tandem.metrics.frontend import E2E_PARTS, PREFILL_PARTS, FrontendMetrics
from tandem.metrics.http import MetricsServer
from tandem.metrics.labels import ControllerLabels, FrontendLabels, RankLabels
from tandem.metrics.rank import RankMetrics
from tandem.wire.messages import Bill, CachedByTier, PrefillAttempt, RankId, RankStats, Role, TierStats
from tandem.wire.request_params import FinishReason
from tandem.wire.scrape_target import ScrapeTarget
from tandem.wire.stream_summary import Route, StreamSummary


def _samples(registry: object) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    from prometheus_client import generate_latest

    text = generate_latest(registry).decode()  # type: ignore[arg-type]
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    matches = [v for (n, ls), v in samples.items() if n == name and set(labels.items()) <= set(ls)]
    assert len(matches) == 1, (name, labels, matches)
    return matches[0]


def _summary() -> StreamSummary:
    attempt = PrefillAttempt(
        attempt=0, prefill_rank=RankId("prefill0", 1), delivered=True, prompt_tokens=40, cached_tokens=32,
        kv_bytes=4096, kv_wait_s=0.3, kv_accept_s=0.001, prefill_queue_s=0.01, prefill_compute_s=0.05,
        kv_transfer_s=0.04, kv_sender_exposed_s=0.02,
    )  # fmt: skip
    bill = Bill(
        prompt_tokens=40, cached_tokens=32, cached_tokens_by_tier=CachedByTier(device=32),
        new_prompt_tokens=8, output_tokens=4, attempts=(attempt,), pickup_s=0.002, reservation_wait_s=0.003,
        decode_s=0.2, rank_s=0.51,
    )  # fmt: skip
    route = Route(
        RankId("prefill0", 1), RankId("decode0", 0), 32, "cache_hit", queue_s=0.004, routing_s=0.001
    )
    return StreamSummary(
        FinishReason.LENGTH, None, [1, 2, 3, 4], "abcd", bill, route, route.prefill_rank, route.decode_rank,
        ttft_s=0.35, e2e_s=0.6, token_gaps_s=(0.05, 0.06, 0.07),
    )  # fmt: skip


def test_a_summary_counts_its_bill_and_observes_each_histogram_once() -> None:
    metrics = FrontendMetrics(FrontendLabels("tiny", "fe"), streams_open=lambda: 3)
    summary = _summary()
    metrics.routed("cache_hit", 32, 40)
    metrics.ended(summary)
    metrics.rejected("INVALID_ARGUMENT")
    s = _samples(metrics.registry)
    assert _value(s, "tandem_requests_total", finish_reason="length", code="OK") == 1
    assert _value(s, "tandem_requests_total", finish_reason="rejected", code="INVALID_ARGUMENT") == 1
    assert _value(s, "tandem_prompt_tokens_total", model="tiny", frontend="fe") == 40
    assert _value(s, "tandem_cached_prompt_tokens_total", tier="device") == 32
    assert _value(s, "tandem_cached_prompt_tokens_total", tier="host") == 0
    assert _value(s, "tandem_cached_prompt_tokens_total", tier="store") == 0
    assert _value(s, "tandem_new_prompt_tokens_total") == 8
    assert _value(s, "tandem_generation_tokens_total") == 4
    assert _value(s, "tandem_time_to_first_token_seconds_sum") == pytest.approx(0.35)
    assert _value(s, "tandem_time_to_first_token_seconds_count") == 1
    assert _value(s, "tandem_inter_token_latency_seconds_count") == 3
    assert _value(s, "tandem_inter_token_latency_seconds_sum") == pytest.approx(0.18)
    assert _value(s, "tandem_request_time_per_output_token_seconds_sum") == pytest.approx((0.6 - 0.35) / 3)
    assert _value(s, "tandem_e2e_request_latency_seconds_sum") == pytest.approx(0.6)
    parts = {part: _value(s, "tandem_request_latency_part_seconds_sum", part=part) for part in E2E_PARTS}
    assert parts == pytest.approx(summary.latency_parts())
    assert sum(parts.values()) <= summary.e2e_s
    exposed = _value(s, "tandem_request_prefill_part_seconds_sum", part="kv_transfer_exposed")
    assert exposed == pytest.approx(0.021)
    assert _value(s, "tandem_router_decisions_total", branch="cache_hit") == 1
    assert _value(s, "tandem_router_predicted_cached_tokens_total") == 32
    assert _value(s, "tandem_router_new_prompt_tokens_total") == 8  # counted when routed
    assert _value(s, "tandem_router_found_cached_tokens_total") == 32
    assert _value(s, "tandem_streams_open") == 3


def test_the_request_and_token_counters_are_per_client_and_start_at_zero_for_each() -> None:
    """Each client the token file names has its series from the start (a rate() over a client's
    first request sees it); a request counts under its own client only, a refusal before any
    token was checked under the anonymous one (``""``)."""
    metrics = FrontendMetrics(FrontendLabels("tiny", "fe"), clients=["alice", "bob"])
    s = _samples(metrics.registry)
    for client in ("", "alice", "bob"):
        for name in (
            "tandem_prompt_tokens_total",
            "tandem_new_prompt_tokens_total",
            "tandem_generation_tokens_total",
        ):
            assert _value(s, name, client=client) == 0
        assert _value(s, "tandem_cached_prompt_tokens_total", client=client, tier="device") == 0
    metrics.ended(_summary(), client="alice")
    metrics.rejected("UNAUTHENTICATED")
    metrics.rejected("INVALID_ARGUMENT", client="bob")
    s = _samples(metrics.registry)
    assert _value(s, "tandem_prompt_tokens_total", client="alice") == 40
    assert _value(s, "tandem_new_prompt_tokens_total", client="alice") == 8
    assert _value(s, "tandem_cached_prompt_tokens_total", client="alice", tier="device") == 32
    assert _value(s, "tandem_generation_tokens_total", client="alice") == 4
    assert _value(s, "tandem_prompt_tokens_total", client="bob") == 0
    assert _value(s, "tandem_requests_total", client="alice", finish_reason="length", code="OK") == 1
    assert _value(s, "tandem_requests_total", client="", code="UNAUTHENTICATED") == 1
    assert _value(s, "tandem_requests_total", client="bob", code="INVALID_ARGUMENT") == 1


def test_cached_prompt_tokens_count_by_tier_and_add_up_to_the_bills() -> None:
    """Bills whose cached tokens came from the host pool and the store count there; the tiers
    summed (the dashboard's sum(rate(...))) are the bills' cached_tokens."""
    metrics = FrontendMetrics(FrontendLabels("tiny", "fe"))
    base = _summary()
    splits = [
        CachedByTier(device=16, host=8, store=8),
        CachedByTier(host=24),
        CachedByTier(device=4, store=12),
    ]
    for split in splits:
        metrics.ended(
            replace(base, bill=replace(base.bill, cached_tokens=split.total, cached_tokens_by_tier=split))
        )
    s = _samples(metrics.registry)
    tiers = {t: _value(s, "tandem_cached_prompt_tokens_total", tier=t) for t in ("device", "host", "store")}
    assert tiers == {"device": 20, "host": 32, "store": 20}
    assert sum(tiers.values()) == sum(split.total for split in splits) == 72
    assert _value(s, "tandem_prompt_tokens_total") == 3 * 40


def test_every_part_series_is_exported_at_zero_before_any_request() -> None:
    """So that rate() over the autoscaler's window counts the first requests: a series that
    first appears with a request's observation already in it has no increase to show."""
    s = _samples(FrontendMetrics(FrontendLabels("tiny", "fe")).registry)
    for name, parts in (
        ("tandem_request_latency_part_seconds", E2E_PARTS),
        ("tandem_request_prefill_part_seconds", PREFILL_PARTS),
    ):
        for part in parts:
            assert _value(s, f"{name}_count", part=part) == 0
            assert _value(s, f"{name}_sum", part=part) == 0
    for tier in ("device", "host", "store"):
        assert _value(s, "tandem_cached_prompt_tokens_total", tier=tier) == 0


def test_a_rank_exports_its_stats_at_scrape() -> None:
    metrics = RankMetrics(RankLabels("tiny", "decode", "decode0", "decode0-r1", "2"))
    stats = RankStats(
        RankId("decode0", 1), Role.DECODE, 2, queued=2, running=5, waiting_for_kv=1, free_pages=10,
        total_pages=40, kv_bytes_received=123, receives_in_flight=1, preemptions=3,
        transfer_failures=(("recv", "timeout", 2),), weight_bytes=7_000_000,
    )  # fmt: skip
    metrics.watch(lambda: stats)
    metrics.step_seconds.observe(0.02)
    metrics.kv_transfer_exposed_seconds.observe(0.004)
    s = _samples(metrics.registry)
    assert _value(s, "tandem_num_requests_running", rank="decode0-r1", incarnation="2", role="decode") == 5
    assert _value(s, "tandem_num_requests_waiting") == 2
    assert _value(s, "tandem_num_requests_waiting_for_kv") == 1
    assert _value(s, "tandem_kv_cache_usage_ratio") == 0.75
    assert _value(s, "tandem_weight_bytes") == 7_000_000
    assert _value(s, "tandem_kv_cache_pages", state="used") == 30
    assert _value(s, "tandem_kv_transfer_bytes_total", direction="recv") == 123
    assert _value(s, "tandem_kv_transfers_in_flight", direction="recv") == 1
    assert _value(s, "tandem_num_preemptions_total") == 3
    assert _value(s, "tandem_kv_transfer_failures_total", direction="recv", cause="timeout") == 2
    assert _value(s, "tandem_step_duration_seconds_count") == 1
    assert _value(s, "tandem_kv_transfer_exposed_seconds_sum") == pytest.approx(0.004)


def test_a_rank_exports_its_kv_tier_figures_at_scrape() -> None:
    metrics = RankMetrics(RankLabels("tiny", "prefill", "prefill0", "prefill0-r0", "1"))
    tiers = TierStats(
        host_pages_total=100, host_pages_used=60, host_load_bytes=1 << 20, host_load_s=0.05,
        store_load_bytes=3 << 20, store_load_s=0.6, store_write_bytes=5 << 20, store_write_s=0.9,
        store_writes=12, store_errors=2, store_rejected=1, recomputed_tokens=256, host_bytes_per_s=2.0e10,
        store_bytes_per_s=5.0e9, prefill_tokens_per_s=4000.0,
    )  # fmt: skip
    stats = RankStats(RankId("prefill0", 0), Role.PREFILL, 1, tiers=tiers)
    metrics.watch(lambda: stats)
    s = _samples(metrics.registry)
    assert _value(s, "tandem_kv_tier_load_bytes_total", tier="host", rank="prefill0-r0") == 1 << 20
    assert _value(s, "tandem_kv_tier_load_bytes_total", tier="store") == 3 << 20
    assert _value(s, "tandem_kv_tier_load_seconds_total", tier="host") == pytest.approx(0.05)
    assert _value(s, "tandem_kv_tier_load_seconds_total", tier="store") == pytest.approx(0.6)
    assert _value(s, "tandem_kv_store_writes_total") == 12
    assert _value(s, "tandem_kv_store_write_bytes_total") == 5 << 20
    assert _value(s, "tandem_kv_store_write_seconds_total") == pytest.approx(0.9)
    assert _value(s, "tandem_kv_store_errors_total") == 2
    assert _value(s, "tandem_kv_store_rejected_blocks_total") == 1
    assert _value(s, "tandem_kv_recomputed_tokens_total") == 256
    assert _value(s, "tandem_kv_host_pages", state="used") == 60
    assert _value(s, "tandem_kv_host_pages", state="free") == 40
    assert _value(s, "tandem_kv_tier_measured_bytes_per_second", tier="host") == 2.0e10
    assert _value(s, "tandem_kv_tier_measured_bytes_per_second", tier="store") == 5.0e9
    assert _value(s, "tandem_prefill_measured_tokens_per_second") == 4000.0


def test_the_controller_exports_group_states_and_restarts() -> None:
    groups = [
        GroupFigures("decode0", "decode", "failed", 3, 2, 2, unplaceable=True),
        GroupFigures("prefill0", "prefill", "ready", 1, 0, 2),
    ]
    s = _samples(ControllerMetrics(ControllerLabels("tiny"), lambda: groups).registry)
    assert _value(s, "tandem_group_state", group="decode0", state="failed") == 1
    assert _value(s, "tandem_group_state", group="decode0", state="ready") == 0
    assert _value(s, "tandem_group_incarnation", group="decode0") == 3
    assert _value(s, "tandem_group_restarts_total", group="decode0") == 2
    assert _value(s, "tandem_group_unplaceable", group="decode0") == 1
    assert _value(s, "tandem_group_unplaceable", group="prefill0") == 0
    assert (
        _value(s, "tandem_pool_ranks", role="prefill") == 2
        and _value(s, "tandem_pool_ranks", role="decode") == 0
    )


def test_the_endpoint_serves_metrics_and_discovery() -> None:
    metrics = FrontendMetrics(FrontendLabels("tiny", "fe"))
    metrics.ended(_summary())
    targets = [ScrapeTarget("127.0.0.1:9", "rank", {"rank": "decode0-r0", "incarnation": "1"})]
    server = MetricsServer(metrics.registry, "127.0.0.1", 0, discovery=lambda: sd_document(targets))
    try:
        base = f"http://{server.address}"
        with urllib.request.urlopen(f"{base}/metrics", timeout=5) as reply:
            assert reply.headers["Content-Type"].startswith("text/plain")
            assert (
                'tandem_generation_tokens_total{client="",frontend="fe",model="tiny"} 4.0'
                in reply.read().decode()
            )
        with urllib.request.urlopen(f"{base}/sd", timeout=5) as reply:
            document = json.load(reply)
        assert document == [
            {
                "targets": ["127.0.0.1:9"],
                "labels": {"tandem_process": "rank", "rank": "decode0-r0", "incarnation": "1"},
            }
        ]
        with pytest.raises(urllib.error.HTTPError) as missing:
            urllib.request.urlopen(f"{base}/nothing", timeout=5)
        assert missing.value.code == 404 and b"/metrics, /sd" in missing.value.read()
    finally:
        server.close()


def test_prometheus_config_points_at_the_discovery_document(capsys: pytest.CaptureFixture[str]) -> None:
    config = yaml.safe_load(prometheus_config("10.0.0.5:9400", scrape_interval_s=2.0))
    (job,) = config["scrape_configs"]
    assert job["honor_labels"] is True and job["http_sd_configs"] == [
        {"url": "http://10.0.0.5:9400/sd", "refresh_interval": "5000ms"}
    ]
    assert config["global"]["scrape_interval"] == "2000ms"
    assert main(["metrics", "prometheus-config", "--addr", "127.0.0.1:9400"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["scrape_configs"][0]["http_sd_configs"][0]["url"] == "http://127.0.0.1:9400/sd"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--addr", "nohost"], "--addr: expected HOST:PORT, got 'nohost'"),
        (["--addr", "h:99999"], "--addr: expected HOST:PORT"),
        (["--addr", "h:1", "--scrape-interval", "0"], "--scrape-interval: must be > 0 seconds"),
    ],
)
def test_prometheus_config_refuses_bad_arguments(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["metrics", "prometheus-config", *args]) == 2
    assert message in capsys.readouterr().err


def test_observe_many_equals_one_observe_a_value() -> None:
    """A request's gaps go into the histogram in one call: the exposition is the same as from
    one ``observe`` a value, on the bucket bounds themselves too."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest

    from tandem.metrics.frontend import observe_many

    values = [0.0, 0.001, 0.0025, 0.0025000001, 0.04, 0.5, 3.0, 1e9]
    registries = (CollectorRegistry(), CollectorRegistry())
    one, many = (
        Histogram("h", "d", ["a"], buckets=(0.0025, 0.04, 1.0), registry=r).labels(a="x") for r in registries
    )
    for value in values:
        one.observe(value)
    many.observe = lambda *_: pytest.fail("observed one value at a time")  # type: ignore[method-assign]
    observe_many(many, values)

    def samples(registry: CollectorRegistry) -> dict[str, float]:
        text = generate_latest(registry).decode()
        pairs = (line.rsplit(" ", 1) for line in text.splitlines() if line and not line.startswith("#"))
        return {name: float(value) for name, value in pairs if "_created" not in name}

    want, got = samples(registries[0]), samples(registries[1])
    assert want.keys() == got.keys() and len(want) == 6  # 4 buckets, count, sum
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-12), name
