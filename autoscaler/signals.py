"""What the policy reads each tick, per pool, and the interface of whatever reads it (a
Prometheus in a deployment, a script in tests, a simulator in the benchmark)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from tandem.wire.messages import Role

# The short range over which ``demand_peak`` reads the prefill pool's arrival rate: three
# scrapes at the default 5 s interval, short enough to see a burst that a group's start outlasts.
BURST_WINDOW_S = 15.0


@dataclass(frozen=True)
class PoolSignals:
    """One pool over the last window. ``None``: no sample in the window (no traffic).

    ``latency_p90_s`` is TTFT's p90 for prefill and ITL's for decode; ``queue_s`` the mean
    prefill queue time (prefill) or reservation wait (decode); ``kv_usage`` the fullest rank's
    KV usage ratio (decode); ``demand`` the load the pool's groups share: new prompt tokens per
    second (prefill) or sequences in flight (decode).

    What the planner reads besides: ``busy_groups`` the mean number of the pool's groups
    computing over the window (prefill); ``backlog`` the work queued and not started (prompt
    tokens waiting for prefill; sequences waiting for a slot and pages on decode); ``prompt_tokens`` the mean
    new prompt tokens per request (prefill); ``context_tokens`` the mean context of a running
    sequence (decode); ``arrival_rate`` the new prompt tokens a second that arrived over the
    window, and ``demand_peak`` the largest such rate over any ``BURST_WINDOW_S`` within it
    (prefill: counted as the router routes them, so a burst reads in full even when the pool
    computes less)."""

    ready_groups: int
    pending_groups: int = 0  # groups starting or draining: an action not finished
    latency_p90_s: float | None = None
    queue_s: float | None = None
    kv_usage: float | None = None
    demand: float | None = None
    busy_groups: float | None = None
    backlog: float | None = None
    prompt_tokens: float | None = None
    context_tokens: float | None = None
    demand_peak: float | None = None
    arrival_rate: float | None = None


class MetricSource(ABC):
    @abstractmethod
    def read(self) -> dict[Role, PoolSignals]:
        """The signals of both pools now."""
