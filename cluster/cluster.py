"""A disaggregated cluster built from a topology: the prefill pool and the decode pool.

:class:`Cluster` starts every group, tells each decode rank the prefill ranks (membership),
places requests on decode ranks, collects their results, and watches the groups: a failed group
is rebuilt whole and the membership sent again. :class:`Controller` is the same as a named Ray
actor, so frontends and tools find it by name.
"""

from __future__ import annotations

import itertools
import time
from typing import Any

import ray

from cluster.dep_group import DEPGroupConfig, GroupState
from cluster.placement import RankResources
from cluster.role_group import RoleGroup
from cluster.topology import Topology
from decode.worker import DecodeResult
from engine.dep_rank import RankRequest

CONTROLLER_NAME = "tandem-controller"


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

    @property
    def groups(self) -> list[RoleGroup]:
        return [*self.prefill, *self.decode]

    def start(self) -> None:
        for g in self.groups:
            g.start()
        self._send_membership()

    def _send_membership(self) -> None:
        ranks: dict[str, Any] = {}
        for g in self.prefill:
            if g.state is GroupState.READY:
                ranks |= g.named_actors()
        ray.get([a.set_prefill_ranks.remote(ranks) for g in self.decode for a in g.actors])

    def submit(self, requests: list[RankRequest]) -> None:
        """Spread requests over the decode ranks, round-robin."""
        ranks = [(gi, r) for gi, g in enumerate(self.decode) for r in range(g.config.size)]
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
        return {g.group_id: f"{g.state.value} (incarnation {g.incarnation})" for g in self.groups}

    def stop(self) -> None:
        for g in self.groups:
            g.stop()


Controller = ray.remote(Cluster)
