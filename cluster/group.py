"""A DEP group of rank actors of one role, seen from the process that runs it (the controller,
or the CLI for a colocated group).

States: ``starting -> ready -> failed -> (restart) starting -> ready ...``; ``stopped`` at the end.
A group is placed, started and restarted whole (gang restart): a rank that dies, or whose loop
fails, takes the group down; every request its ranks still owed a result through ``collect``
ends with :class:`GroupFailed`'s message, and ``restart`` builds a new incarnation on a new
placement group. (Requests streamed to a frontend end there: it sees the group fail.)
"""

from __future__ import annotations

import logging
import re
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import ray
from ray.util.placement_group import PlacementGroup
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from tandem.cluster.node_roles import label_selector
from tandem.cluster.placement import (
    PlacementTimeout,
    RankResources,
    live_nodes,
    place_group,
    placement_group_by_id,
    release_group,
)
from tandem.cluster.rank_actor import RankActor
from tandem.cluster.rank_spec import MetricsSpec, RankSpec
from tandem.cluster.topology import PlacementSpec
from tandem.engine.role_spec import RoleSpec
from tandem.wire.messages import Bill, ProcessPlace, RankId, RankRequest, RankStats, RequestResult, Role
from tandem.wire.request_params import FinishReason
from tandem.wire.routing_view import GroupState

log = logging.getLogger(__name__)


class GroupNotReady(RuntimeError):
    def __init__(self, group_id: str, state: GroupState) -> None:
        super().__init__(f"DEP group {group_id} is {state.value}, not ready")


class GroupFailed(RuntimeError):
    def __init__(self, group_id: str, incarnation: int, reason: str) -> None:
        super().__init__(f"DEP group {group_id} incarnation {incarnation} failed: {reason}")
        self.group_id, self.incarnation, self.reason = group_id, incarnation, reason


@dataclass(frozen=True)
class GroupConfig:
    group_id: str
    model_dir: str
    size: int
    role: RoleSpec
    dtype: str = "float32"
    resources: RankResources | None = None  # None: detected from the Ray cluster at start
    collective_timeout_s: float = 60.0
    start_timeout_s: float = 300.0
    metrics: MetricsSpec | None = None  # None: the ranks serve no metrics
    placement: PlacementSpec | None = None  # node roles by label; None: any node
    place_timeout_s: float = 120.0  # for the placement group to be ready
    # the placement group outlives the job that started it (ranks always outlive the process
    # that started them: a controller that restarts adopts them, see ``adopt``)
    detached: bool = False
    deployment: str = ""  # the deployment's name, in its placement groups' names
    # pin rank r's process to cores: (the ordinal of rank 0 in the deployment, cores per rank)
    cores: tuple[int, int] | None = None
    env: tuple[tuple[str, str], ...] = ()  # added to each rank process's environment at its start


class RankGroup:
    def __init__(self, config: GroupConfig) -> None:
        if config.size < 1:
            raise ValueError(f"a DEP group needs at least one rank, got size {config.size}")
        self.config = config
        self.incarnation = 0
        self.state = GroupState.STOPPED
        self.failure: str | None = None
        self.unplaceable = False  # the last start found no room on the nodes of its role
        self.dead = True  # every rank of the last incarnation is confirmed gone (see _teardown)
        self._actors: list[Any] = []  # RankActor handles, by rank
        self._loops: dict[ray.ObjectRef, int] = {}  # each rank's ``run`` call
        self._collecting: dict[int, ray.ObjectRef] = {}  # rank -> its ``collect`` call not yet answered
        self._pg: PlacementGroup | None = None
        self._in_flight: dict[str, int] = {}  # request id -> rank, for results through collect
        self.metrics_addresses: dict[RankId, str] = {}  # each rank's /metrics, this incarnation
        self.places: dict[RankId, ProcessPlace] = {}  # each rank's node and pid, this incarnation
        # placement group names are global to the Ray namespace: two clusters (or a test's
        # leftovers) that both have a "prefill0" must not collide
        self._placement_tag = uuid.uuid4().hex[:8]
        self._tries = 0  # placements asked for, in this group's placement group names

    @property
    def group_id(self) -> str:
        return self.config.group_id

    @property
    def role(self) -> str:
        return self.config.role.role.value

    @property
    def rank_ids(self) -> list[RankId]:
        return [RankId(self.group_id, rank) for rank in range(self.config.size)]

    @property
    def actors(self) -> dict[RankId, Any]:
        """Each rank's actor handle (empty unless started)."""
        return dict(zip(self.rank_ids, self._actors, strict=False))

    def start(self, place_timeout_s: float | None = None) -> None:
        """Place and start a new incarnation; returns when every rank is ready to step. Raises
        :class:`GroupFailed` (the group is then failed, its ranks and placement group freed)."""
        cfg = self.config
        self.state, self.failure = GroupState.STARTING, None
        try:
            resources = cfg.resources or RankResources.detect()
            # a new incarnation once placed: tries that find no room are not starts
            self._tries += 1
            tag = f"{self._placement_tag}{self._tries}"
            parts = (cfg.deployment, cfg.group_id, str(self.incarnation + 1), tag)
            self._pg = place_group(
                "-".join(p for p in parts if p),
                cfg.size,
                resources,
                cfg.place_timeout_s if place_timeout_s is None else place_timeout_s,
                self.selector(),
                cfg.detached,
            )
            self.incarnation += 1
            bundle = resources.bundle()
            self._actors = [
                RankActor.options(  # type: ignore[attr-defined]
                    name=rank_actor_name(cfg.group_id, self.incarnation, rank, self._placement_tag),
                    num_cpus=bundle.get("CPU", 0),
                    num_gpus=bundle.get("GPU", 0),
                    lifetime="detached",
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        self._pg, placement_group_bundle_index=rank
                    ),
                    runtime_env={"env_vars": dict(cfg.env)} if cfg.env else None,
                ).remote(self._spec(rank_id))
                for rank, rank_id in enumerate(self.rank_ids)
            ]
            places = ray.get([a.place.remote() for a in self._actors], timeout=cfg.start_timeout_s)
            self.places = dict(zip(self.rank_ids, places, strict=True))
            master = str(ray.get(self._actors[0].rendezvous_address.remote(), timeout=cfg.start_timeout_s))
            ray.get([a.setup.remote(master) for a in self._actors], timeout=cfg.start_timeout_s)
            addresses = ray.get(
                [a.metrics_address.remote() for a in self._actors], timeout=cfg.start_timeout_s
            )
            self.metrics_addresses = {r: a for r, a in zip(self.rank_ids, addresses, strict=True) if a}
        except Exception as exc:
            self._teardown()
            why = _cause(exc) if isinstance(exc, ray.exceptions.RayError) else str(exc)
            self.state, self.failure = GroupState.FAILED, f"start failed: {why}"
            self.unplaceable = isinstance(exc, PlacementTimeout)
            raise GroupFailed(cfg.group_id, self.incarnation, self.failure) from exc
        self._loops = {a.run.remote(): rank for rank, a in enumerate(self._actors)}
        self.state, self.unplaceable = GroupState.READY, False

    def adopt(self, actors: list[Any], incarnation: int) -> None:
        """Take over a running incarnation's ranks (a restarted controller finds them by name):
        where they run, their metrics and placement group, and a watch on each loop. A rank
        that does not answer fails the group, which is then rebuilt like any failed group."""
        self.incarnation, self._actors, self.state = incarnation, list(actors), GroupState.STARTING
        try:
            timeout = self.config.start_timeout_s
            places = ray.get([a.place.remote() for a in self._actors], timeout=timeout)
            addresses = ray.get([a.metrics_address.remote() for a in self._actors], timeout=timeout)
            pg_id = ray.get(self._actors[0].placement_group_id.remote(), timeout=timeout)
        except Exception as exc:
            why = _cause(exc) if isinstance(exc, ray.exceptions.RayError) else str(exc)
            self._fail(f"adopting incarnation {incarnation} failed: {why}")
            return
        self.places = dict(zip(self.rank_ids, places, strict=True))
        self.metrics_addresses = {r: a for r, a in zip(self.rank_ids, addresses, strict=True) if a}
        self._pg = placement_group_by_id(pg_id) if pg_id else None
        self._loops = {a.watch_loop.remote(): rank for rank, a in enumerate(self._actors)}
        self.state, self.failure = GroupState.READY, None

    def selector(self) -> dict[str, str] | None:
        """The node label selector of this group's bundles, for the nodes alive now."""
        cfg = self.config
        if cfg.placement is None or cfg.role.role is Role.COLOCATED:
            return None
        return label_selector(cfg.placement, cfg.role.role, live_nodes())

    def _spec(self, rank_id: RankId) -> RankSpec:
        cfg = self.config
        return RankSpec(
            rank_id,
            self.incarnation,
            cfg.size,
            cfg.model_dir,
            cfg.dtype,
            cfg.role,
            cfg.collective_timeout_s,
            cfg.metrics,
            None if cfg.cores is None else (cfg.cores[0] + rank_id.rank, cfg.cores[1]),
        )

    def submit(self, rank: int, requests: list[RankRequest]) -> None:
        """Queue requests on one rank (checked there: ``InvalidRequestError`` for bad input)."""
        if self.state is not GroupState.READY:
            raise GroupNotReady(self.group_id, self.state)
        if not 0 <= rank < self.config.size:
            raise ValueError(f"rank {rank} is not in DEP group {self.group_id} of {self.config.size} ranks")
        try:
            ray.get(self._actors[rank].submit.remote(requests))
        except ray.exceptions.RayTaskError as exc:
            raise exc.as_instanceof_cause() from None
        for r in requests:
            if r.frontend is None:
                self._in_flight[r.request_id] = rank

    def abort(self, request_ids: Iterable[str]) -> None:
        by_rank: dict[int, list[str]] = {}
        for request_id in request_ids:
            if request_id in self._in_flight:
                by_rank.setdefault(self._in_flight[request_id], []).append(request_id)
        ray.get([self._actors[rank].abort.remote(ids) for rank, ids in by_rank.items()])

    def poll(self, wait_s: float = 0.5) -> list[RequestResult]:
        """Finished requests of every rank (waiting up to ``wait_s`` for some). Finds a failed
        rank: the group is marked failed and torn down, and every request still in flight on any
        rank comes back with :class:`GroupFailed`'s message naming the cause."""
        if self.state is not GroupState.READY:
            return []
        for rank, actor in enumerate(self._actors):
            if rank not in self._collecting:  # one collect out per rank: a slow one is waited for
                self._collecting[rank] = actor.collect.remote(wait_s)
        refs = {ref: rank for rank, ref in self._collecting.items()}
        answered, _ = ray.wait(list(refs), num_returns=len(refs), timeout=wait_s + 5.0)
        finished: list[RequestResult] = []
        deaths: list[str] = []
        errors: list[str] = []
        erring: list[ray.ObjectRef] = []  # loops of ranks that reported errors
        for ref in answered:
            rank = refs[ref]
            del self._collecting[rank]
            try:
                results: list[RequestResult] = ray.get(ref)
            except ray.exceptions.RayActorError:
                deaths.append(f"rank {rank} died")
                continue
            except Exception as exc:
                errors.append(f"rank {rank}: {_cause(exc)}")
                continue
            finished.extend(results)
            if any(r.error is not None for r in results):
                erring += [loop for loop, r in self._loops.items() if r == rank]
        if erring:  # a failing loop reports its requests' errors just before it ends
            ray.wait(erring, num_returns=len(erring), timeout=1.0)
        self._check(deaths, errors)
        if self.state is not GroupState.FAILED:
            for done in finished:
                self._in_flight.pop(done.request_id, None)
            return finished
        assert self.failure is not None
        message = str(GroupFailed(self.group_id, self.incarnation, self.failure))
        results = [r if r.error is None else replace(r, error=message) for r in finished]
        returned = {r.request_id for r in results}
        results += [
            RequestResult(i, (), FinishReason.ERROR, Bill(), RankId(self.group_id, rank), error=message)
            for i, rank in self._in_flight.items()
            if i not in returned
        ]
        self._in_flight.clear()
        return results

    def check(self) -> None:
        """Fail the group if a rank died or its loop ended, without calling any rank (the
        controller's watch: its ranks push their results, nothing waits in ``collect``)."""
        if self.state is GroupState.READY:
            self._check([], [])

    def _check(self, deaths: list[str], errors: list[str]) -> None:
        ended, _ = ray.wait(list(self._loops), num_returns=len(self._loops), timeout=0)
        for loop_ref in ended:
            rank = self._loops[loop_ref]
            try:
                ray.get(loop_ref)
                errors.append(f"rank {rank} stopped stepping")
            except ray.exceptions.RayActorError:
                deaths.append(f"rank {rank} died")
            except Exception as exc:
                errors.append(f"rank {rank}: {_cause(exc)}")
        if deaths or errors:
            # a dead rank is the cause; its peers' collective errors are the consequence
            self._fail(sorted(set(deaths))[0] if deaths else errors[0])

    def run_to_completion(self, timeout_s: float) -> list[RequestResult]:
        """Poll until nothing is in flight (or ``timeout_s`` passes, raising ``TimeoutError``)."""
        deadline = time.monotonic() + timeout_s
        results: list[RequestResult] = []
        while self._in_flight:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(self._in_flight)} requests of group {self.group_id} still running")
            results.extend(self.poll())
        return results

    def stats(self) -> list[RankStats]:
        return list(ray.get([a.stats.remote() for a in self._actors]))

    def check_integrity(self) -> None:
        """Page accounting on every rank."""
        ray.get([a.check_integrity.remote() for a in self._actors])

    def restart(self, place_timeout_s: float | None = None) -> None:
        """Gang restart: tear every rank down and start a new incarnation (waiting
        ``place_timeout_s`` for its placement, the config's by default)."""
        self._teardown()
        self.start(place_timeout_s)

    def stop(self) -> None:
        self._teardown()
        self.state = GroupState.STOPPED

    def _fail(self, reason: str) -> None:
        if self.state is GroupState.FAILED:
            return
        log.warning("DEP group %s incarnation %d failed: %s", self.group_id, self.incarnation, reason)
        self.state, self.failure = GroupState.FAILED, reason
        self._teardown()

    def _teardown(self, wait_dead_s: float = 10.0) -> None:
        """Kill every rank and wait (up to ``wait_dead_s``) until Ray reports each one dead: its
        loop call ends with an actor error once its process is gone. The death is the fence
        peers rely on (``dead``): no write of the old incarnation can land after it."""
        for actor in self._actors:
            ray.kill(actor)
        loops = list(self._loops)
        if loops:
            ended, _ = ray.wait(loops, num_returns=len(loops), timeout=wait_dead_s)
            self.dead = len(ended) == len(loops)
        self._actors, self._loops, self._collecting = [], {}, {}
        self.metrics_addresses, self.places = {}, {}
        if self._pg is not None:
            release_group(self._pg)
            self._pg = None


def start_groups(groups: Sequence[RankGroup], concurrency: int | None = None) -> None:
    """Start groups side by side, ``concurrency`` at a time (``None``: all at once; 1: one after
    another): each one's placement, rank processes, model load and rendezvous overlap the
    others'. Returns once every start has ended; then raises the first :class:`GroupFailed`
    (every group that failed is already failed and freed; the others are ready)."""
    if concurrency is not None and concurrency < 1:
        raise ValueError(f"start concurrency: expected at least 1 group at a time, got {concurrency}")
    if not groups:
        return
    workers = len(groups) if concurrency is None else min(concurrency, len(groups))
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="group-start") as pool:
        futures = [pool.submit(g.start) for g in groups]
    errors = [f.exception() for f in futures if f.exception() is not None]
    if errors:
        raise errors[0]  # type: ignore[misc]


_RANK_ACTOR = re.compile(r"^tandem-rank-(?P<group>[a-z0-9-]+)-i(?P<inc>\d+)-r(?P<rank>\d+)-[0-9a-f]+$")


def rank_actor_name(group_id: str, incarnation: int, rank: int, tag: str) -> str:
    """A rank actor's name in its deployment's namespace: what a restarted controller finds."""
    return f"tandem-rank-{group_id}-i{incarnation}-r{rank}-{tag}"


def parse_rank_actor_name(name: str) -> tuple[str, int, int] | None:
    """``(group id, incarnation, rank)`` of a rank actor's name; ``None`` for other names."""
    match = _RANK_ACTOR.match(name)
    if match is None:
        return None
    return match["group"], int(match["inc"]), int(match["rank"])


def _cause(exc: Exception) -> str:
    if isinstance(exc, ray.exceptions.RayTaskError):
        return str(exc.cause) if exc.cause is not None else str(exc)
    return f"{type(exc).__name__}: {exc}"
