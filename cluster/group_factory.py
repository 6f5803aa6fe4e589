"""The groups of each pool, made from one template a pool (its role, DEP size, resources,
metrics, placement): the topology's groups at the start, one more at a time after it (named
after the pool, never reusing a name), and again by id when a restarted controller adopts the
groups the autoscaler had added. With ``pin_cores_per_rank`` each rank gets cores of its own, by
the rank's ordinal across the cluster."""

from __future__ import annotations

from dataclasses import replace

from tandem.cluster.group import GroupConfig, RankGroup
from tandem.cluster.placement import RankResources
from tandem.cluster.rank_spec import MetricsSpec
from tandem.cluster.topology import PoolSpec, Topology
from tandem.engine.role_spec import RoleSpec
from tandem.wire.messages import Role


class GroupFactory:
    def __init__(
        self,
        topology: Topology,
        model_dir: str,
        dtype: str,
        resources: RankResources,
        metrics: MetricsSpec | None,
        detached: bool,
        deployment: str,
        rank_env: tuple[tuple[str, str], ...],
    ) -> None:
        self._topology, self._model_dir, self._dtype = topology, model_dir, dtype
        self._metrics, self._detached, self._deployment = metrics, detached, deployment
        self._rank_env = rank_env
        self._resources = resources
        self._templates: dict[Role, GroupConfig] = {}
        self._next_index: dict[Role, int] = {}
        self._next_ordinal = 0  # of the next group's first rank, for core pinning

    def pool(self, name: str, pool: PoolSpec, role: RoleSpec) -> list[RankGroup]:
        """The topology's groups of one pool, named ``<name>0``, ``<name>1``..."""
        template = GroupConfig(
            f"{name}0",
            self._model_dir,
            pool.dep,
            role,
            self._dtype,
            self._resources,
            metrics=self._metrics,
            placement=self._topology.placement,
            detached=self._detached,
            deployment=self._deployment,
            env=self._rank_env,
        )
        self._templates[role.role] = template
        self._next_index[role.role] = pool.groups
        return [self._made(replace(template, group_id=f"{name}{i}")) for i in range(pool.groups)]

    def new(self, role: Role) -> RankGroup:
        """One more group for ``role``'s pool, not started."""
        if role not in self._templates:
            raise ValueError(f"role: expected prefill or decode, got {role!r}")
        index = self._next_index[role]
        self._next_index[role] = index + 1
        return self._made(replace(self._templates[role], group_id=f"{role.value}{index}"))

    def remade(self, group_id: str) -> tuple[Role, RankGroup] | None:
        """A group the autoscaler had added, made again by its id (no cores pinned: its ranks
        run already); ``None`` when no pool names groups so."""
        for role, template in self._templates.items():
            index = group_id.removeprefix(role.value)
            if index != group_id and index.isdigit():
                self._next_index[role] = max(self._next_index[role], int(index) + 1)
                return role, RankGroup(replace(template, group_id=group_id))
        return None

    def _made(self, config: GroupConfig) -> RankGroup:
        per_rank, ordinal = self._topology.pin_cores_per_rank, self._next_ordinal
        self._next_ordinal += config.size
        return RankGroup(replace(config, cores=None if per_rank is None else (ordinal, per_rank)))
