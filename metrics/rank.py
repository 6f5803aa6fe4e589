"""A rank's metrics. Gauges and counters are read from the rank's own ``RankStats`` when
Prometheus scrapes (nothing is done per step for them); the histograms are observed where their
event happens: a step's time and batch in the loop, a transfer's time on its sender, its exposed
time on its receiver."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.engine.speculation import MAX_SPECULATIVE_TOKENS
from tandem.metrics.frontend import PART_BUCKETS
from tandem.metrics.labels import RankLabels
from tandem.wire.messages import RankStats, Role, TierStats

STEP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TRANSFER_BUCKETS = PART_BUCKETS
SPEC_STEP_BUCKETS = tuple(float(n) for n in range(1, MAX_SPECULATIVE_TOKENS + 2))
Family = TypeVar("Family", CounterMetricFamily, GaugeMetricFamily)


class RankMetrics:
    """One rank's registry. ``watch(stats)`` gives the collector its source once the loop exists."""

    def __init__(self, labels: RankLabels) -> None:
        self.labels = labels
        self.registry = CollectorRegistry(auto_describe=True)
        names = list(labels.as_dict())
        base = labels.as_dict()
        r = self.registry
        self.step_seconds = Histogram(
            "tandem_step_duration_seconds",
            "One step of the rank's loop (its forward, sampling, bookkeeping)",
            names,
            buckets=STEP_BUCKETS,
            registry=r,
        ).labels(**base)
        self.batch_tokens = Histogram(
            "tandem_step_batch_tokens",
            "Tokens in one step's batch (0: a step that only serves the group's MoE)",
            names,
            buckets=(0, *BATCH_TOKEN_BUCKETS),
            registry=r,
        ).labels(**base)
        self.spec_step_tokens = Histogram(
            "tandem_spec_acceptance_length",
            "Output tokens one decode step gave one request with speculative decoding on "
            "(1 + its accepted drafts; the mean is the acceptance length)",
            names,
            buckets=SPEC_STEP_BUCKETS,
            registry=r,
        ).labels(**base)
        self.kv_transfer_seconds = Histogram(
            "tandem_kv_transfer_seconds",
            "A KV transfer on its sender: first write posted -> last write completed",
            names,
            buckets=TRANSFER_BUCKETS,
            registry=r,
        ).labels(**base)
        self.kv_transfer_exposed_seconds = Histogram(
            "tandem_kv_transfer_exposed_seconds",
            "A KV transfer's exposed part, complete on its receiver: last layer computed -> KV usable",
            names,
            buckets=TRANSFER_BUCKETS,
            registry=r,
        ).labels(**base)
        self._collector = _StatsCollector(labels)
        r.register(self._collector)

    def watch(self, stats: Callable[[], RankStats]) -> None:
        self._collector.stats = stats


class _StatsCollector(Collector):
    def __init__(self, labels: RankLabels) -> None:
        self.labels = labels
        self.stats: Callable[[], RankStats] | None = None

    def describe(self) -> list[Metric]:
        return []  # families depend on the role; none are registered twice

    def collect(self) -> Iterator[Metric]:
        if self.stats is None:
            return
        s = self.stats()
        names = list(self.labels.as_dict())
        values = list(self.labels.as_dict().values())

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(name, doc, labels=names)
            g.add_metric(values, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(name, doc, labels=names)
            c.add_metric(values, value)
            return c

        running = s.computing if s.role is Role.PREFILL else s.running
        yield gauge(
            "tandem_num_requests_running",
            "Requests in the rank's batch (a prefill rank: jobs being computed)",
            running,
        )
        yield gauge("tandem_num_requests_waiting", "Requests queued for pages or a batch slot", s.queued)
        yield gauge(
            "tandem_num_requests_waiting_for_kv", "Decode requests whose KV is on its way", s.waiting_for_kv
        )
        yield gauge(
            "tandem_num_requests_transferring", "Prefill jobs whose KV is being written", s.transferring
        )
        yield gauge(
            "tandem_weight_bytes",
            "Bytes of model weights resident on the rank's device (FP8 weights 1 byte each, plus scales)",
            s.weight_bytes,
        )
        used = s.total_pages - s.free_pages
        yield gauge(
            "tandem_kv_cache_usage_ratio",
            "Pages in use / pages in the pool (cached, evictable pages count as free)",
            used / s.total_pages if s.total_pages else 0.0,
        )
        pages = GaugeMetricFamily("tandem_kv_cache_pages", "KV pool pages by state", labels=[*names, "state"])
        pages.add_metric([*values, "used"], used)
        pages.add_metric([*values, "free"], s.free_pages)
        pages.add_metric([*values, "cached"], s.cached_pages)
        yield pages
        yield from _transfer_families(s, names, values)
        yield counter(
            "tandem_num_preemptions", "Requests preempted for pages (recomputed later)", s.preemptions
        )
        if s.role is not Role.PREFILL:
            yield counter(
                "tandem_spec_draft_tokens",
                "Draft tokens proposed for verification (speculative decoding)",
                s.speculation.draft_tokens,
            )
            yield counter(
                "tandem_spec_accepted_tokens",
                "Draft tokens that verification accepted (each equal to the target's own token)",
                s.speculation.accepted_tokens,
            )
        yield counter(
            "tandem_prefix_cache_queries_tokens",
            "Prompt tokens looked up in the prefix cache",
            s.prefix_queried_tokens,
        )
        yield counter(
            "tandem_prefix_cache_hits_tokens", "Prompt tokens found in the prefix cache", s.prefix_hit_tokens
        )
        yield counter("tandem_steps", "Steps of the rank's loop", s.loop.steps)
        yield counter("tandem_step_seconds", "Time in steps of the rank's loop", s.loop.step_s)
        yield from _tier_families(s.tiers, names, values)


def _transfer_families(s: RankStats, names: list[str], values: list[str]) -> Iterator[Metric]:
    """KV transfers: open ones by direction, the bytes moved, the failures by direction and cause."""
    flights = GaugeMetricFamily(
        "tandem_kv_transfers_in_flight", "KV transfers open on this rank", labels=[*names, "direction"]
    )
    flights.add_metric([*values, "send"], s.sends_in_flight)
    flights.add_metric([*values, "recv"], s.receives_in_flight)
    yield flights
    moved = CounterMetricFamily(
        "tandem_kv_transfer_bytes",
        "KV bytes moved, as the write descriptors covered (sent: on the sender; received: on the receiver)",
        labels=[*names, "direction"],
    )
    moved.add_metric([*values, "send"], s.kv_bytes_sent)
    moved.add_metric([*values, "recv"], s.kv_bytes_received)
    yield moved
    failures = CounterMetricFamily(
        "tandem_kv_transfer_failures",
        "Failed KV transfers by direction and cause",
        labels=[*names, "direction", "cause"],
    )
    for direction, cause, count in s.transfer_failures:
        failures.add_metric([*values, direction, cause], count)
    yield failures


# (name, help, TierStats field) of the counters that have one series per rank
_TIER_COUNTERS = (
    ("tandem_kv_store_writes", "Blocks written to the store", "store_writes"),
    ("tandem_kv_store_write_bytes", "KV bytes written to the store", "store_write_bytes"),
    ("tandem_kv_store_write_seconds", "Time the store writes took", "store_write_s"),
    ("tandem_kv_store_errors", "Store calls that failed or timed out", "store_errors"),
    (
        "tandem_kv_store_slow_fetches",
        "Store fetches not answered within recomputing's price: misses that back the store off",
        "store_slow",
    ),
    (
        "tandem_kv_store_rejected_blocks",
        "Blocks read from the store that failed their check (corrupt, truncated, another model or layout)",
        "store_rejected",
    ),
    (
        "tandem_kv_recomputed_tokens",
        "Cached prompt tokens computed again because loading them was priced slower",
        "recomputed_tokens",
    ),
)


def _tier_families(t: TierStats, names: list[str], values: list[str]) -> Iterator[Metric]:
    """The KV tiers below the device pages: loads from the host pool and the store, the store's
    writes and failures, recomputes chosen over loads, the host pool's pages, measured prices."""

    def by_tier(family: Family, host: float, store: float) -> Family:
        family.add_metric([*values, "host"], host)
        family.add_metric([*values, "store"], store)
        return family

    def one(family: Family, value: float) -> Family:
        family.add_metric(values, value)
        return family

    tier = [*names, "tier"]
    loaded = "KV bytes loaded into device pages, by the tier read"
    yield by_tier(
        CounterMetricFamily("tandem_kv_tier_load_bytes", loaded, labels=tier),
        t.host_load_bytes,
        t.store_load_bytes,
    )
    took = "Time the loads into device pages took, by the tier read (the rank's own clock)"
    yield by_tier(
        CounterMetricFamily("tandem_kv_tier_load_seconds", took, labels=tier), t.host_load_s, t.store_load_s
    )
    for name, doc, field in _TIER_COUNTERS:
        yield one(CounterMetricFamily(name, doc, labels=names), getattr(t, field))
    pages = GaugeMetricFamily(
        "tandem_kv_host_pages", "Host-memory pool pages by state", labels=[*names, "state"]
    )
    pages.add_metric([*values, "used"], t.host_pages_used)
    pages.add_metric([*values, "free"], t.host_pages_total - t.host_pages_used)
    yield pages
    bandwidth = (
        "The rank's measured load bandwidth from each tier, which prices a load against a recompute "
        "(0 until measured)"
    )
    yield by_tier(
        GaugeMetricFamily("tandem_kv_tier_measured_bytes_per_second", bandwidth, labels=tier),
        t.host_bytes_per_s,
        t.store_bytes_per_s,
    )
    rate = "The rank's measured prefill rate, which prices a recompute against a load (0 until measured)"
    yield one(
        GaugeMetricFamily("tandem_prefill_measured_tokens_per_second", rate, labels=names),
        t.prefill_tokens_per_s,
    )
