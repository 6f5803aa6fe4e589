"""What the controller must find again when Ray restarts its actor: the autoscaler's settings,
the groups drained and the removals under way. Kept in Ray's GCS internal KV, one record per
deployment (keyed by its Ray namespace), written whenever one of them changes.

Why the GCS KV: it lives in the GCS, not in the controller's process or node, so it outlives the
actor's restart; it needs no process of ours (a detached actor holding the state would be one
more thing to restart, adopt and stop) and no disk shared between nodes; a write is one small
RPC, made only when a drain starts or ends or the autoscaler starts. It is lost with the Ray
cluster's GCS (without GCS fault tolerance), and then the deployment is gone with it.

A removal is written before its group is drained (write-ahead): a controller restarted at any
point finds every group whose ranks were told to drain, so none is left refusing work unseen.
Deadlines are wall-clock times, since the restarted process has a new monotonic clock."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from typing import Any

from ray.experimental import internal_kv

log = logging.getLogger(__name__)

KV_NAMESPACE = "tandem-controller"


@dataclass(frozen=True)
class AutoscalerSettings:
    """What ``Controller.start_autoscaler`` was given; a restarted controller starts it again
    with these. ``drain_timeout_s``: how long a drain may wait for its group's requests before
    it is cancelled (the topology's ``autoscaling:`` has no field for it)."""

    prometheus_url: str
    dry_run: bool = False
    drain_timeout_s: float = 300.0


@dataclass(frozen=True)
class Removal:
    """A group being drained to be stopped: ``started_unix_s`` when its drain began, cancelled
    if it still holds requests ``timeout_s`` later; ``by_autoscaler`` whether the autoscaler
    decided it (a restarted autoscaler carries it on as its own action)."""

    group_id: str
    started_unix_s: float
    timeout_s: float
    by_autoscaler: bool = False

    @property
    def deadline_unix_s(self) -> float:
        return self.started_unix_s + self.timeout_s


@dataclass(frozen=True)
class ControllerRecord:
    """``draining``: every group that takes no new work (the removals' groups among them)."""

    autoscaler: AutoscalerSettings | None = None
    draining: tuple[str, ...] = ()
    removing: tuple[Removal, ...] = ()

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ControllerRecord:
        raw: dict[str, Any] = json.loads(text)
        settings = raw.get("autoscaler")
        return cls(
            autoscaler=AutoscalerSettings(**settings) if settings is not None else None,
            draining=tuple(raw.get("draining", ())),
            removing=tuple(Removal(**r) for r in raw.get("removing", ())),
        )


class RecordStore:
    """One deployment's :class:`ControllerRecord` in the GCS KV (needs a connected Ray)."""

    def __init__(self, deployment_namespace: str) -> None:
        self.key = f"{deployment_namespace or 'default'}/record".encode()

    def load(self) -> ControllerRecord:
        """The record last saved; an empty one if there is none or it cannot be read."""
        raw = internal_kv._internal_kv_get(self.key, namespace=KV_NAMESPACE)
        if raw is None:
            return ControllerRecord()
        try:
            return ControllerRecord.from_json(raw.decode())
        except (ValueError, TypeError, KeyError) as exc:  # a record of another version
            log.warning("controller record %s unreadable (%s): starting without it", self.key, exc)
            return ControllerRecord()

    def save(self, record: ControllerRecord) -> None:
        internal_kv._internal_kv_put(self.key, record.to_json().encode(), True, namespace=KV_NAMESPACE)

    def clear(self) -> None:
        internal_kv._internal_kv_del(self.key, namespace=KV_NAMESPACE)
