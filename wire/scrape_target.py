"""One Prometheus ``/metrics`` endpoint of the deployment, as processes report theirs."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class ScrapeTarget:
    address: str  # host:port of a /metrics endpoint
    process: str  # frontend, controller or rank
    labels: dict[str, str] = field(default_factory=dict)
