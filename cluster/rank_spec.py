"""What a rank actor is started with: its id, group size, model, role and metrics (torch-free)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.role_spec import RoleSpec
from tandem.metrics.http import MetricsSecurity
from tandem.wire.messages import RankId


@dataclass(frozen=True)
class MetricsSpec:
    """Serve the rank's Prometheus metrics, labelled with ``model``, on ``host`` (empty: the
    node's address, which the rest of the cluster reaches) and a port the OS picks."""

    model: str
    host: str = ""
    security: MetricsSecurity = field(default_factory=MetricsSecurity)  # the deployment's token and TLS


@dataclass(frozen=True)
class RankSpec:
    rank_id: RankId
    incarnation: int
    world_size: int
    model_dir: str
    dtype: str
    role: RoleSpec
    collective_timeout_s: float = 60.0
    metrics: MetricsSpec | None = None
    cores: tuple[int, int] | None = None  # (its ordinal in the deployment, cores per rank): pinned
