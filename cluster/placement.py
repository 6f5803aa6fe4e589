"""Placement of a DEP group: one Ray placement group, one bundle per rank.

On GPU nodes a bundle is ``{"GPU": 1}`` plus a CPU; elsewhere a fraction of a CPU, so that many
ranks share a small machine. ``PACK`` keeps a group on as few nodes as fit (its all-to-all is the
hot collective); Ray's autoscaler adds nodes for a group that fits nowhere.
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group


class PlacementTimeout(TimeoutError):
    def __init__(self, group_id: str, size: int, waited_s: float, bundle: dict[str, float]) -> None:
        super().__init__(
            f"group {group_id}: {size} bundles of {bundle} not placed within {waited_s:.0f}s; "
            f"the cluster has {ray.available_resources()} free"
        )


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
    group_id: str, size: int, resources: RankResources, timeout_s: float = 120.0
) -> PlacementGroup:
    bundle = resources.bundle()
    pg = placement_group([dict(bundle) for _ in range(size)], strategy="PACK", name=f"tandem-{group_id}")
    ready, _ = ray.wait([pg.ready()], timeout=timeout_s)
    if not ready:
        remove_placement_group(pg)
        raise PlacementTimeout(group_id, size, timeout_s, bundle)
    return pg


def release_group(pg: PlacementGroup) -> None:
    remove_placement_group(pg)
