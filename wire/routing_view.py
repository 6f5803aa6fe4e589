"""The controller's view of the deployment, as frontends and tools read it: every group with its
state, the rank actors that take work, the frontends, the metrics targets. Requests never pass
through the controller: frontends route over this view."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from tandem.wire.autoscaler_decision import Decision
from tandem.wire.messages import ProcessPlace, RankId, Role
from tandem.wire.scrape_target import ScrapeTarget


class GroupState(enum.StrEnum):
    """A DEP group's state. ``DRAINING`` is the controller's, shown in views: the group is ready
    but takes no new requests while its running ones finish (a group itself is never in it)."""

    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


CONTROLLER_NAME = "tandem-controller"


@dataclass(frozen=True)
class GroupView:
    group_id: str
    role: Role
    state: GroupState
    incarnation: int
    ranks: tuple[RankId, ...]
    places: tuple[ProcessPlace, ...] = ()  # each rank's node and pid, while started
    failure: str | None = None  # why it failed (a rebuild that cannot be placed says so here)
    unplaceable: bool = False  # its last start found no room on the nodes of its role


@dataclass(frozen=True)
class FrontendInfo:
    """A frontend as it registers with the controller: its gRPC address, its metrics target and
    where it runs."""

    name: str
    address: str  # host:port of its gRPC server
    place: ProcessPlace
    metrics_target: ScrapeTarget | None = None


@dataclass(frozen=True)
class RoutingView:
    """What a frontend routes over: the rank actors of groups that take work, by role, and
    every group's state. A rebuilt group's ranks keep their ids and get new handles."""

    prefill: dict[RankId, Any]
    decode: dict[RankId, Any]
    groups: tuple[GroupView, ...]
    page_size: int
    prefill_capacity_tokens: int  # KV one prefill rank holds: a prompt's ceiling
    decode_capacity_tokens: int  # KV one decode rank holds: prompt + output's ceiling
    # every /metrics of the cluster: the controller's and each rank's of every started group
    metrics_targets: tuple[ScrapeTarget, ...] = ()
    # the autoscaler's latest decisions, (Unix time, decision), oldest first; empty when it is off
    autoscaler_decisions: tuple[tuple[float, Decision], ...] = ()
    frontends: tuple[FrontendInfo, ...] = ()  # every frontend that registered
    controller: ProcessPlace | None = None
    deployment: str = ""  # the deployment's name (its Ray namespace)
    colocated: bool = False  # its ranks prefill and decode: each is in `prefill` and in `decode`
