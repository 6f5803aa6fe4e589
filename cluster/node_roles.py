"""Which Ray nodes a pool's groups may use, and where a topology's groups would go.

A node's role is a Ray node label (``ray start --labels tandem.io/role=prefill``; the key and the
values are the topology's ``placement:``). Each group's placement group carries a
``bundle_label_selector`` for its role::

    node labelled prefill ─▶ prefill groups only
    node labelled decode  ─▶ decode groups only
    node without the label ─▶ either role, when unlabelled_nodes is "any", or "auto" and no live
                              node carries a role label; never with "never"

("auto" keeps a labelled cluster's roles apart even while every node of one role is lost: a
group waits for a node of its role rather than landing on the head.)

The "either role" case is a selector on the other role's value (``!decode``), which a node
without the key matches. :func:`plan` is the dry run: it packs each group's bundles onto the
nodes its selector admits, largest free node first (as ``PACK`` does), and says for a group
that fits nowhere what it needed and what the admitted nodes have. Pure Python: no Ray here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tandem.cluster.topology import PlacementSpec, Topology
from tandem.wire.messages import Role


@dataclass(frozen=True)
class NodeInfo:
    """A live Ray node: its id, address, labels and its (total) resources."""

    node_id: str
    address: str
    labels: Mapping[str, str]
    resources: Mapping[str, float]


def _role_value(spec: PlacementSpec, role: Role) -> str:
    return spec.prefill_label if role is Role.PREFILL else spec.decode_label


def _other_value(spec: PlacementSpec, role: Role) -> str:
    return spec.decode_label if role is Role.PREFILL else spec.prefill_label


def label_selector(spec: PlacementSpec, role: Role, nodes: Sequence[NodeInfo]) -> dict[str, str]:
    """The ``bundle_label_selector`` of one bundle of a ``role`` group, given the live nodes."""
    value = _role_value(spec, role)
    unlabelled = spec.unlabelled_nodes
    if unlabelled == "auto":
        roles = {spec.prefill_label, spec.decode_label}
        labelled = any(n.labels.get(spec.label_key) in roles for n in nodes)
        unlabelled = "never" if labelled else "any"
    if unlabelled == "never":
        return {spec.label_key: value}
    return {spec.label_key: f"!{_other_value(spec, role)}"}


def admits(selector: Mapping[str, str], node: NodeInfo) -> bool:
    """Whether ``node`` matches ``selector`` (the two forms :func:`label_selector` makes)."""
    for key, wanted in selector.items():
        have = node.labels.get(key)
        if wanted.startswith("!"):
            if have == wanted[1:]:
                return False
        elif have != wanted:
            return False
    return True


def describe_selector(selector: Mapping[str, str]) -> str:
    """E.g. ``tandem.io/role=prefill`` or ``tandem.io/role!=decode``."""
    return ", ".join(
        f"{k}!={v[1:]}" if v.startswith("!") else f"{k}={v}" for k, v in sorted(selector.items())
    )


@dataclass(frozen=True)
class GroupPlan:
    """Where one group's ranks would go (``nodes[rank]``), or why it cannot be placed."""

    group_id: str
    role: Role
    selector: dict[str, str]
    nodes: tuple[NodeInfo, ...] = ()
    problem: str | None = None

    def describe(self) -> str:
        where = describe_selector(self.selector)
        if self.problem is not None:
            return f"{self.group_id} ({self.role.value}, nodes {where}): cannot be placed: {self.problem}"
        ranks = ", ".join(f"rank {i} on {n.node_id[:12]} ({n.address})" for i, n in enumerate(self.nodes))
        return f"{self.group_id} ({self.role.value}, nodes {where}): {ranks}"


@dataclass
class _Free:
    node: NodeInfo
    resources: dict[str, float] = field(default_factory=dict)

    def fits(self, bundle: Mapping[str, float]) -> bool:
        return all(self.resources.get(k, 0.0) + 1e-9 >= v for k, v in bundle.items())

    def take(self, bundle: Mapping[str, float]) -> None:
        for k, v in bundle.items():
            self.resources[k] = self.resources.get(k, 0.0) - v


def plan(topology: Topology, nodes: Sequence[NodeInfo], bundle: Mapping[str, float]) -> list[GroupPlan]:
    """Each group of ``topology`` (prefill pool, then decode), packed onto ``nodes`` in turn;
    a group that does not fit takes nothing, so the groups after it are still planned."""
    free = [_Free(n, dict(n.resources)) for n in nodes]
    plans: list[GroupPlan] = []
    for role, pool in ((Role.PREFILL, topology.prefill), (Role.DECODE, topology.decode)):
        selector = label_selector(topology.placement, role, nodes)
        for index in range(pool.groups):
            group_id = f"{role.value}{index}"
            eligible = [f for f in free if admits(selector, f.node)]
            trial = [_Free(f.node, dict(f.resources)) for f in eligible]
            taken = {id(t): f for t, f in zip(trial, eligible, strict=True)}  # trial is re-sorted below
            chosen: list[NodeInfo] = []
            for _ in range(pool.dep):
                # PACK: the node this group already uses first, then the roomiest
                trial.sort(key=lambda f: (f.node not in chosen, -f.resources.get("CPU", 0.0)))
                spot = next((f for f in trial if f.fits(bundle)), None)
                if spot is None:
                    break
                spot.take(bundle)
                chosen.append(spot.node)
            if len(chosen) < pool.dep:
                problem = _why(pool.dep, bundle, eligible, nodes)
                plans.append(GroupPlan(group_id, role, selector, problem=problem))
                continue
            for t in trial:
                taken[id(t)].resources = t.resources
            plans.append(GroupPlan(group_id, role, selector, tuple(chosen)))
    return plans


def _why(size: int, bundle: Mapping[str, float], eligible: list[_Free], nodes: Sequence[NodeInfo]) -> str:
    need = f"{size} bundles of {dict(bundle)}"
    if not eligible:
        return f"needs {need}; no live node has the label (of {len(nodes)} nodes)"
    have = "; ".join(f"{f.node.node_id[:12]} has {_short(f.resources)}" for f in eligible)
    return f"needs {need}; the nodes it may use have: {have}"


def _short(resources: Mapping[str, float]) -> str:
    keys = [k for k in ("CPU", "GPU", "memory") if k in resources]
    return "{" + ", ".join(f"{k}: {resources[k]:g}" for k in keys) + "}"
