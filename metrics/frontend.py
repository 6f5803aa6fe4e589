"""The frontend's metrics: requests by how they ended, the latency histograms an operator reads
first, the latency composition of every request's bill, token counters that equal the sums of the
bills, and the router's decisions. Names follow vLLM's where one exists (the docs, "Metrics and dashboards").

Everything is observed once per request, when its summary is made; nothing per token."""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tandem.metrics.labels import FrontendLabels
from tandem.wire.kv_events import TIERS

if TYPE_CHECKING:
    from tandem.wire.stream_summary import StreamSummary

# vLLM's boundaries, so that panels and habits carry over
# fmt: off
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
    80.0,
)
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)
PART_BUCKETS = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
    120.0,
)
# fmt: on

# The parts of a request's end-to-end latency, in order (each on one process's clock; the
# flights between processes are in none of them)
E2E_PARTS = ("queue", "routing", "pickup", "reservation_wait", "kv_wait", "kv_accept", "decode")
# Inside kv_wait, on the prefill rank's clock
PREFILL_PARTS = ("prefill_pickup", "prefill_queue", "prefill_compute", "kv_transfer", "kv_transfer_exposed")


class FrontendMetrics:
    """The frontend's series. The request and token counters carry the ``client`` label: the
    authenticated client's name (``clients``, the token file's names, each at zero from the
    start), or ``""`` without tokens or before a call was authenticated, so their cardinality is
    bounded by the token file."""

    def __init__(
        self,
        labels: FrontendLabels,
        streams_open: Callable[[], int] | None = None,
        clients: Sequence[str] = (),
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = labels
        names = list(labels.as_dict())
        base = labels.as_dict()
        r = self.registry
        self._requests = Counter(
            "tandem_requests",
            "Requests ended, by finish reason (stop, length, abort, error; rejected: refused before "
            "any stream), gRPC status code and client",
            [*names, "finish_reason", "code", "client"],
            registry=r,
        )
        self._base = base
        self._children: dict[tuple[Any, ...], Any] = {}  # labelled children, by metric and labels

        self._latency_histograms(names, base)
        self._token_counters(names, clients)
        self._router_counters(names, base)
        if streams_open is not None:
            Gauge("tandem_streams_open", "Requests this frontend is streaming now", names, registry=r).labels(
                **base
            ).set_function(streams_open)

    def _latency_histograms(self, names: list[str], base: dict[str, str]) -> None:
        """TTFT, ITL, TPOT, end-to-end and queue time, and each part of a request's latency."""
        r = self.registry

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            """This frontend's series of a histogram."""
            return Histogram(name, doc, names, buckets=buckets, registry=r).labels(**base)

        def by_part(name: str, doc: str) -> Histogram:
            """A histogram with a series for each part of a request's latency."""
            return Histogram(name, doc, [*names, "part"], buckets=PART_BUCKETS, registry=r)

        self.ttft = histogram(
            "tandem_time_to_first_token_seconds",
            "Request arrival at the frontend -> its first token at the frontend",
            TTFT_BUCKETS,
        )
        self.itl = histogram(
            "tandem_inter_token_latency_seconds",
            "Gap between consecutive output tokens of a request, on its decode rank's clock",
            ITL_BUCKETS,
        )
        self.tpot = histogram(
            "tandem_request_time_per_output_token_seconds",
            "A request's (end-to-end - time to first token) / (output tokens - 1)",
            ITL_BUCKETS,
        )
        self.e2e = histogram(
            "tandem_e2e_request_latency_seconds",
            "Request arrival at the frontend -> its result at the frontend",
            E2E_BUCKETS,
        )
        self.queue = histogram(
            "tandem_request_queue_time_seconds",
            "Request arrival at the frontend -> routed (waiting for a running slot included)",
            PART_BUCKETS,
        )
        self._parts = by_part(
            "tandem_request_latency_part_seconds",
            'Each part of the end-to-end latency composition of a request (see the docs, "The bill")',
        )
        self._prefill_parts = by_part(
            "tandem_request_prefill_part_seconds",
            "The parts of a request's KV wait measured on its prefill ranks, summed over its attempts",
        )
        # every part's series exists at zero from the start: a series born at its first
        # observation has no earlier sample, so rate() never sees the increase that created it
        # (the autoscaler's queue signals were missing until a later request ended)
        for part in E2E_PARTS:
            self._child(self._parts, part=part)
        for part in PREFILL_PARTS:
            self._child(self._prefill_parts, part=part)

    def _token_counters(self, names: list[str], clients: Sequence[str]) -> None:
        """Prompt, cached (by tier), new and output tokens, per client."""
        r = self.registry

        def per_client(name: str, doc: str) -> Counter:
            return Counter(name, doc, [*names, "client"], registry=r)

        self._prompt_tokens = per_client(
            "tandem_prompt_tokens", "Prompt tokens of ended requests (the sum of the bills' prompt_tokens)"
        )
        self._cached_prompt_tokens = Counter(
            "tandem_cached_prompt_tokens",
            "Prompt tokens found in a prefill rank's prefix cache, by the tier they came from: device "
            "pages, host-memory pool, shared store (the sum of the bills' cached_tokens_by_tier)",
            [*names, "tier", "client"],
            registry=r,
        )
        self._new_prompt_tokens = per_client(
            "tandem_new_prompt_tokens",
            "Prompt tokens a prefill rank computed (the sum of the bills' new_prompt_tokens)",
        )
        self._generation_tokens = per_client(
            "tandem_generation_tokens",
            "Output tokens of ended requests (the sum of the bills' output_tokens)",
        )
        for client in dict.fromkeys(["", *clients]):  # at zero from the start, as the parts above
            for tier in TIERS:
                self._child(self._cached_prompt_tokens, tier=tier, client=client)
            for metric in (self._prompt_tokens, self._new_prompt_tokens, self._generation_tokens):
                self._child(metric, client=client)

    def _router_counters(self, names: list[str], base: dict[str, str]) -> None:
        """The router's decisions and its predictions against what the ranks found."""
        r = self.registry

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, names, registry=r)

        self._route = Counter(
            "tandem_router_decisions",
            "Routing decisions, by the branch of the prefill policy that chose the rank",
            [*names, "branch"],
            registry=r,
        )
        self.predicted_cached = counter(
            "tandem_router_predicted_cached_tokens",
            "Prompt tokens the router predicted its chosen prefill rank holds",
        ).labels(**base)
        self.routed_new_tokens = counter(
            "tandem_router_new_prompt_tokens",
            "Prompt tokens past the prefix the router predicted cached, counted as it routes each "
            "request: the prefill pool's demand as it arrives",
        ).labels(**base)
        self.found_cached = counter(
            "tandem_router_found_cached_tokens",
            "Prompt tokens the chosen prefill rank found cached at the request's first attempt",
        ).labels(**base)
        self.migrations = counter(
            "tandem_request_migrations",
            "Requests moved to another decode rank because theirs failed (each resumed there)",
        ).labels(**base)

    def routed(self, branch: str, predicted_cached_tokens: int, prompt_tokens: int) -> None:
        """A request routed: its branch, the cached tokens predicted, and the new ones its
        ``prompt_tokens`` leave (what its prefill will compute, as far as the router knows)."""
        self._child(self._route, branch=branch).inc()
        self.predicted_cached.inc(predicted_cached_tokens)
        self.routed_new_tokens.inc(max(0, prompt_tokens - predicted_cached_tokens))

    def rejected(self, code: str, finish_reason: str = "rejected", client: str = "") -> None:
        """A request refused before it had a stream (``INVALID_ARGUMENT``, ``UNAVAILABLE``, ...),
        or whose client went away before its end (``CANCELLED``, finish reason ``abort``)."""
        self._child(self._requests, finish_reason=finish_reason, code=code, client=client).inc()

    def _child(self, metric: Any, **labels: str) -> Any:
        """``metric.labels(**base, **labels)``, looked up once (the client's lookup costs more
        than the observation it is for)."""
        key = (id(metric), *labels.values())
        child = self._children.get(key)
        if child is None:
            child = self._children[key] = metric.labels(**self._base, **labels)
        return child

    def ended(self, summary: StreamSummary, code: str = "OK", client: str = "") -> None:
        """A request of ``client`` whose stream ended with ``summary``."""
        bill = summary.bill
        self._child(self._requests, finish_reason=str(summary.finish_reason), code=code, client=client).inc()
        self._child(self._prompt_tokens, client=client).inc(bill.prompt_tokens)
        for tier, tokens in bill.cached_tokens_by_tier.as_dict().items():
            if tokens:
                self._child(self._cached_prompt_tokens, tier=tier, client=client).inc(tokens)
        self._child(self._new_prompt_tokens, client=client).inc(bill.new_prompt_tokens)
        self._child(self._generation_tokens, client=client).inc(len(summary.token_ids))
        if bill.attempts and bill.attempts[0].delivered:
            self.found_cached.inc(bill.attempts[0].cached_tokens)
        self.e2e.observe(summary.e2e_s)
        if summary.token_ids:
            self.ttft.observe(summary.ttft_s)
        observe_many(self.itl, summary.token_gaps_s)
        if len(summary.token_ids) > 1:
            self.tpot.observe((summary.e2e_s - summary.ttft_s) / (len(summary.token_ids) - 1))
        for part, seconds in summary.latency_parts().items():
            self._child(self._parts, part=part).observe(seconds)
        if summary.route is not None:
            self.queue.observe(summary.route.queue_s)
        if bill.attempts:
            for part, seconds in prefill_parts(summary).items():
                self._child(self._prefill_parts, part=part).observe(seconds)


def observe_many(histogram: Histogram, values: Sequence[float]) -> None:
    """``histogram.observe(v)`` for every value, with one update per bucket and one to the sum
    (a request's token gaps: one call per request instead of one per token). Uses the client's
    bucket bounds and values; a client without them gets one ``observe`` a value."""
    bounds = getattr(histogram, "_upper_bounds", None)
    buckets = getattr(histogram, "_buckets", None)
    total = getattr(histogram, "_sum", None)
    if bounds is None or buckets is None or total is None or len(bounds) != len(buckets):
        for value in values:
            histogram.observe(value)
        return
    ordered = sorted(values)  # a bucket's count is then two searches apart, not a search a value
    below = 0
    for bucket, bound in zip(buckets, bounds, strict=True):
        upto = bisect_right(ordered, bound, below)  # values <= bound: the histogram's rule
        if upto > below:
            bucket.inc(upto - below)
        below = upto
    total.inc(sum(values))


def prefill_parts(summary: StreamSummary) -> dict[str, float]:
    bill = summary.bill
    return {
        "prefill_pickup": bill.prefill_pickup_s,
        "prefill_queue": bill.prefill_queue_s,
        "prefill_compute": bill.prefill_compute_s,
        "kv_transfer": bill.kv_transfer_s,
        "kv_transfer_exposed": bill.kv_transfer_exposed_s,
    }
