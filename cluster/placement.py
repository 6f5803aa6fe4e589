"""Placement of a DEP group: one Ray placement group, one bundle per rank.

On GPU nodes a bundle is ``{"GPU": 1}`` plus a CPU; elsewhere a fraction of a CPU, so that many
ranks share a small machine. ``PACK`` keeps a group on as few nodes as fit (its all-to-all is the
hot collective) and spans nodes when one is too small; every bundle carries the role's node
label selector (``node_roles.py``). Ray's autoscaler adds nodes for a group that fits nowhere.
A detached deployment's placement groups are detached too: they outlive the command that
made them, and ``tandem stop`` removes them.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray import PlacementGroupID
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group

from tandem.cluster.node_roles import NodeInfo, describe_selector


class PlacementTimeout(TimeoutError):
    def __init__(
        self, group_id: str, size: int, waited_s: float, bundle: dict[str, float], selector: dict[str, str]
    ) -> None:
        where = f" on nodes {describe_selector(selector)}" if selector else ""
        free = {k: v for k, v in ray.available_resources().items() if k in ("CPU", "GPU")}
        super().__init__(
            f"placement group {group_id}: {size} bundles of {bundle}{where} not placed within "
            f"{waited_s:.0f}s; the cluster has {free} free"
        )


def live_nodes() -> list[NodeInfo]:
    """The cluster's live nodes with their labels and total resources."""
    return [
        NodeInfo(n["NodeID"], n["NodeManagerAddress"], dict(n.get("Labels") or {}), dict(n["Resources"]))
        for n in ray.nodes()
        if n["Alive"]
    ]


@dataclass(frozen=True)
class RankResources:
    use_gpu: bool = False
    cpus_per_rank: float = 0.1

    @staticmethod
    def detect(cpus_per_rank: float = 0.1) -> RankResources:
        """One GPU per rank when the Ray cluster has GPUs, else a share of a CPU."""
        return RankResources(use_gpu=ray.cluster_resources().get("GPU", 0) > 0, cpus_per_rank=cpus_per_rank)

    def bundle(self) -> dict[str, float]:
        if self.use_gpu:
            return {"GPU": 1.0, "CPU": max(self.cpus_per_rank, 1.0)}
        return {"CPU": self.cpus_per_rank}


def place_group(
    group_id: str,
    size: int,
    resources: RankResources,
    timeout_s: float = 120.0,
    selector: dict[str, str] | None = None,
    detached: bool = False,
) -> PlacementGroup:
    """A ready placement group of ``size`` bundles on nodes matching ``selector``; on timeout
    it is removed again and :class:`PlacementTimeout` raised."""
    bundle = resources.bundle()
    pg = placement_group(
        [dict(bundle) for _ in range(size)],
        strategy="PACK",
        name=f"tandem-{group_id}",
        lifetime="detached" if detached else None,
        bundle_label_selector=[dict(selector) for _ in range(size)] if selector else None,
    )
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementTimeout(group_id, size, timeout_s, bundle, selector or {})
    return pg


def placement_group_by_id(hex_id: str) -> PlacementGroup:
    """The placement group with this hex id (as a rank reports it), to release it later."""
    return PlacementGroup(PlacementGroupID(bytes.fromhex(hex_id)))


def release_group(pg: PlacementGroup) -> None:
    remove_placement_group(pg)
