"""A disaggregated cluster built from a topology: the prefill pool and the decode pool.

:class:`Cluster` starts every group, tells each decode rank the prefill ranks (membership),
places requests on decode ranks, collects their results, and watches the groups: a failed group
is rebuilt whole and the membership sent again. :class:`Controller` is the same as a named Ray
actor, so frontends and tools find it by name.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass
from typing import Any

import ray

from tandem.cluster.dep_group import DEPGroupConfig, GroupState
from tandem.cluster.placement import RankResources
from tandem.cluster.role_group import RoleGroup
from tandem.cluster.topology import Topology
from tandem.decode.worker import DecodeResult
from tandem.engine.dep_rank import RankRequest

CONTROLLER_NAME = "tandem-controller"


@dataclass(frozen=True)
class GroupView:
    group_id: str
    role: str
    state: str  # starting, ready, draining, failed or stopped
    incarnation: int
    ranks: list[str]


@dataclass(frozen=True)
class RoutingView:
    """What a frontend routes over: the rank actors of groups that take work, by role, and
    every group's state. A rebuilt group's ranks keep their names and get new handles."""

    prefill: dict[str, Any]
    decode: dict[str, Any]
    groups: list[GroupView]
    page_size: int
    prefill_capacity_tokens: int  # KV one prefill rank holds: a prompt's ceiling
    decode_capacity_tokens: int  # KV one decode rank holds: prompt + output's ceiling


class Cluster:
    def __init__(self, topology: Topology, model_dir: str, dtype: str = "float32") -> None:
        self.topology = topology
        resources = RankResources.detect(topology.cpus_per_rank)

        def group(role: str, index: int, pool: Any) -> RoleGroup:
            config = DEPGroupConfig(f"{role}{index}", model_dir, pool.dep, dtype, resources=resources)
            return RoleGroup(config, role, pool, topology.kv_transfer == "layerwise", topology.kv_timeout_s)

        self.prefill = [group("prefill", i, topology.prefill) for i in range(topology.prefill.groups)]
        self.decode = [group("decode", i, topology.decode) for i in range(topology.decode.groups)]
        self._next_decode = itertools.count()
        self._placement: dict[str, tuple[int, int]] = {}  # request id -> (decode group, rank)
        self._draining: set[str] = set()

    @property
    def groups(self) -> list[RoleGroup]:
        return [*self.prefill, *self.decode]

    def start(self) -> None:
        """Start every group; if one fails, stop those already started (their ranks and
        placement groups) before raising, so a failed start leaves nothing behind."""
        try:
            for g in self.groups:
                g.start()
            self._send_membership()
        except BaseException:
            for g in self.groups:
                g.stop()
            raise

    def _send_membership(self) -> None:
        """Tell every live decode rank the prefill ranks that take jobs (ready, not draining)."""
        ranks: dict[str, Any] = {}
        for g in self.prefill:
            if g.state is GroupState.READY and g.group_id not in self._draining:
                ranks |= g.named_actors()
        ray.get(
            [
                a.set_prefill_ranks.remote(ranks)
                for g in self.decode
                if g.state is GroupState.READY
                for a in g.actors
            ]
        )

    def membership(self) -> dict[str, list[str]]:
        """Rank names of the groups that take work, by role (what a frontend routes over)."""
        live = [g for g in self.groups if g.state is GroupState.READY and g.group_id not in self._draining]
        return {
            role: [n for g in live if g.role == role for n in g.named_actors()]
            for role in ("prefill", "decode")
        }

    def routing_view(self) -> RoutingView:
        def state(g: RoleGroup) -> str:
            draining = g.group_id in self._draining and g.state is GroupState.READY
            return "draining" if draining else g.state.value

        live = [g for g in self.groups if g.state is GroupState.READY and g.group_id not in self._draining]
        views = [
            GroupView(
                g.group_id, g.role, state(g), g.incarnation, [g.rank_name(r) for r in range(g.config.size)]
            )
            for g in self.groups
        ]
        return RoutingView(
            prefill={n: a for g in live if g.role == "prefill" for n, a in g.named_actors().items()},
            decode={n: a for g in live if g.role == "decode" for n, a in g.named_actors().items()},
            groups=views,
            page_size=self.topology.prefill.page_size,
            prefill_capacity_tokens=self.topology.prefill.num_pages * self.topology.prefill.page_size,
            decode_capacity_tokens=self.topology.decode.num_pages * self.topology.decode.page_size,
        )

    def drain(self, group_id: str) -> None:
        """Stop sending a group new work; what it has runs to the end. (A later ``stop_group``
        removes it once idle.)"""
        if group_id not in {g.group_id for g in self.groups}:
            raise ValueError(f"no group {group_id!r}; groups: {sorted(g.group_id for g in self.groups)}")
        self._draining.add(group_id)
        self._send_membership()

    def submit(self, requests: list[RankRequest]) -> None:
        """Spread requests over the decode ranks of groups that take work, round-robin."""
        ranks = [
            (gi, r)
            for gi, g in enumerate(self.decode)
            if g.state is GroupState.READY and g.group_id not in self._draining
            for r in range(g.config.size)
        ]
        if not ranks:
            raise RuntimeError(f"no decode group takes work: {self.status()}")
        by_rank: dict[tuple[int, int], list[RankRequest]] = {}
        for request in requests:
            where = ranks[next(self._next_decode) % len(ranks)]
            by_rank.setdefault(where, []).append(request)
            self._placement[request.request_id] = where
        for (gi, r), batch in by_rank.items():
            self.decode[gi].submit(r, batch)

    def poll(self, wait_s: float = 0.2) -> list[DecodeResult]:
        results: list[DecodeResult] = []
        for g in self.decode:
            results.extend(g.poll(wait_s))
        for g in self.prefill:
            g.poll(0.0)
        return results

    def run_to_completion(self, request_ids: set[str], timeout_s: float) -> dict[str, DecodeResult]:
        deadline = time.monotonic() + timeout_s
        done: dict[str, DecodeResult] = {}
        while request_ids - done.keys():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(request_ids - done.keys())} requests still running")
            done |= {r.request_id: r for r in self.poll()}
        return done

    def heal(self) -> list[str]:
        """Rebuild every failed group (gang restart) and resend the membership; the rebuilt ids."""
        rebuilt = []
        for g in self.groups:
            if g.state is GroupState.FAILED:
                g.restart()
                rebuilt.append(g.group_id)
        if rebuilt:
            self._send_membership()
        return rebuilt

    def stats(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for g in self.groups:
            if g.state is GroupState.READY:
                out.extend(ray.get([a.stats.remote() for a in g.actors]))
        return out

    def check_integrity(self) -> None:
        for g in self.groups:
            if g.state is GroupState.READY:
                g.check_integrity()

    def status(self) -> dict[str, str]:
        return {v.group_id: f"{v.state} (incarnation {v.incarnation})" for v in self.routing_view().groups}

    def stop(self) -> None:
        for g in self.groups:
            g.stop()


@ray.remote(max_concurrency=8)  # type: ignore[call-overload]
class Controller:
    """The cluster as a named Ray actor (``tandem-controller``): frontends and tools find it by
    name. A watch thread collects results and rebuilds failed groups every ``health_interval_s``.

    ``routing_view`` answers from a copy refreshed after every change, without the lock: a
    group's rebuild holds the lock for as long as its ranks take to start, and frontends must
    see the failed group (and route around it) meanwhile."""

    def __init__(
        self, topology: Topology, model_dir: str, dtype: str = "float32", health_interval_s: float = 0.5
    ):
        import threading

        self.cluster = Cluster(topology, model_dir, dtype)
        self.health_interval_s = health_interval_s
        self._lock = threading.Lock()
        self._results: dict[str, DecodeResult] = {}
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_loop, daemon=True)
        self._view = self.cluster.routing_view()
        self.rebuilt: list[str] = []

    def start(self) -> dict[str, str]:
        with self._lock:
            self.cluster.start()
            self._view = self.cluster.routing_view()
        self._watch.start()
        return self.cluster.status()

    def _watch_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                for result in self.cluster.poll(0.02):
                    self._results[result.request_id] = result
                self._view = self.cluster.routing_view()  # a failure shows before the rebuild
            with self._lock:
                rebuilt = self.cluster.heal()
                if rebuilt:
                    self.rebuilt += rebuilt
                    self._view = self.cluster.routing_view()
            self._stop.wait(0.01 if self._results else self.health_interval_s / 10)

    def submit(self, requests: list[RankRequest]) -> None:
        with self._lock:
            self.cluster.submit(requests)

    def results(self, request_ids: list[str], timeout_s: float) -> dict[str, DecodeResult]:
        """Wait for these requests' results (those done within ``timeout_s``), removing them."""
        deadline = time.monotonic() + timeout_s
        while True:
            with self._lock:
                if all(i in self._results for i in request_ids) or time.monotonic() > deadline:
                    return {i: self._results.pop(i) for i in request_ids if i in self._results}
            time.sleep(0.01)

    def status(self) -> dict[str, str]:
        with self._lock:
            return self.cluster.status()

    def membership(self) -> dict[str, list[str]]:
        with self._lock:
            return self.cluster.membership()

    def routing_view(self) -> RoutingView:
        return self._view

    def drain(self, group_id: str) -> None:
        with self._lock:
            self.cluster.drain(group_id)
            self._view = self.cluster.routing_view()

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self.cluster.stop()
