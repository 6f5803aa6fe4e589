"""What ``ClusterStatus`` reports: every group and rank as the controller and the ranks see
them, with the frontend's router view of each rank beside it."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import ray

from tandem.frontend.client_usage import ClientUsage
from tandem.router.router import Router
from tandem.wire.autoscaler_decision import Decision
from tandem.wire.messages import ProcessPlace, RankId, RankStats
from tandem.wire.routing_view import FrontendInfo, RoutingView


@dataclass
class RankStatusView:
    name: str
    role: str
    stats: RankStats | None = None
    routed_prefill_tokens: int = 0
    routed_requests: int = 0
    indexed_blocks: int = 0
    integrity: str = ""
    place: ProcessPlace | None = None


@dataclass
class GroupStatusView:
    group_id: str
    role: str
    state: str
    incarnation: int
    ranks: list[RankStatusView] = field(default_factory=list)
    failure: str | None = None
    unplaceable: bool = False


@dataclass
class StatusView:
    model: str
    ready: bool
    groups: list[GroupStatusView]
    router_counters: dict[str, int]
    running_requests: int
    autoscaler_decisions: tuple[tuple[float, Decision], ...] = ()
    deployment: str = ""
    controller: ProcessPlace | None = None
    frontends: tuple[FrontendInfo, ...] = ()
    clients: tuple[ClientUsage, ...] = ()  # the answering frontend's, by client


async def read_status(
    view: RoutingView | None,
    router: Router[RankId],
    model: str,
    ready: bool,
    running: int,
    check_integrity: bool,
) -> StatusView:
    """Ask every rank at once (``stats``, and ``check_integrity`` when asked)."""
    if view is None:
        return StatusView(model, False, [], router.counters(), running)
    loads, blocks = router.loads(), router.cached_blocks()
    handles = view.prefill | view.decode

    async def rank_status(rank: RankId, role: str) -> RankStatusView:
        status = RankStatusView(rank.name, role)
        handle = handles.get(rank)
        if handle is not None:
            try:
                status.stats = await handle.stats.remote()
                if check_integrity:
                    await handle.check_integrity.remote()
                    status.integrity = "ok"
            except ray.exceptions.RayError as exc:
                lines = str(exc).strip().splitlines()
                status.integrity = lines[-1] if lines else type(exc).__name__
        status.routed_prefill_tokens = loads.prefill_tokens.get(rank, 0)
        status.routed_requests = loads.decode_requests.get(rank, 0)
        status.indexed_blocks = blocks.get(rank, 0)
        return status

    groups = []
    for g in view.groups:
        ranks = await asyncio.gather(*[rank_status(rank, g.role.value) for rank in g.ranks])
        for rank, place in zip(ranks, g.places, strict=False):
            rank.place = place
        groups.append(
            GroupStatusView(
                g.group_id, g.role.value, g.state, g.incarnation, list(ranks), g.failure, g.unplaceable
            )
        )
    return StatusView(
        model,
        ready,
        groups,
        router.counters(),
        running,
        view.autoscaler_decisions,
        view.deployment,
        view.controller,
        view.frontends,
    )
