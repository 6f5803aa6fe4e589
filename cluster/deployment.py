"""A deployment seen from outside it: where its groups would go (dry run), what runs where
(status) and taking it down (stop), from any process that can reach the Ray cluster.

A deployment is found by its name, which is its Ray namespace: the controller there is named
``tandem-controller`` and lists the frontends that registered with it.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import asdict
from typing import Any

import ray
from ray.util.placement_group import placement_group_table

from tandem.cluster.group import parse_rank_actor_name
from tandem.cluster.node_roles import GroupPlan, plan
from tandem.cluster.placement import RankResources, live_nodes
from tandem.cluster.topology import Topology
from tandem.wire.messages import ProcessPlace
from tandem.wire.routing_view import CONTROLLER_NAME, GroupState, RoutingView


class NoDeployment(LookupError):
    def __init__(self, name: str, address: str) -> None:
        super().__init__(f"--name: no deployment named {name!r} runs on the Ray cluster at {address}")


def dry_run(topology: Topology) -> list[GroupPlan]:
    """Where each group of ``topology`` would go on the connected cluster's live nodes, as
    their total resources allow; nothing is started."""
    return plan(topology, live_nodes(), RankResources.detect(topology.cpus_per_rank).bundle())


def find_controller(name: str, address: str) -> Any:
    try:
        return ray.get_actor(CONTROLLER_NAME)
    except ValueError:
        raise NoDeployment(name, address) from None


def _place(place: ProcessPlace | None) -> dict[str, Any] | None:
    if place is None:
        return None
    out = asdict(place)
    out["labels"] = dict(place.labels)
    return out


def describe(view: RoutingView) -> dict[str, Any]:
    """The deployment as JSON-ready data: its controller, frontends and every rank of every
    group, each with its node (id, address, labels) and process id."""
    groups = []
    for g in view.groups:
        places = dict(zip(g.ranks, g.places, strict=False))
        ranks = [{"rank": r.name, **(_place(places.get(r)) or {})} for r in g.ranks]
        groups.append(
            {
                "group": g.group_id,
                "role": g.role.value,
                "state": g.state,
                "incarnation": g.incarnation,
                "failure": g.failure,
                "unplaceable": g.unplaceable,
                "ranks": ranks,
            }
        )
    frontends = [
        {
            "name": f.name,
            "address": f.address,
            "metrics": f.metrics_target.address if f.metrics_target else None,
            **(_place(f.place) or {}),
        }
        for f in view.frontends
    ]
    return {
        "deployment": view.deployment,
        "controller": _place(view.controller),
        "frontends": frontends,
        "groups": groups,
        "autoscaler": autoscaler_advice(view),
    }


def autoscaler_advice(view: RoutingView) -> dict[str, Any] | None:
    """Each pool's latest autoscaler decision and the planner's advice beside it: the size it
    plans and why, and the latency it predicts at the current and the planned size (``None``
    where it cannot predict: unmeasured, or a size that cannot keep up). ``None`` when the
    autoscaler is off."""
    if not view.autoscaler_decisions:
        return None
    latest = {d.pool: (at, d) for at, d in view.autoscaler_decisions}
    out = {}
    for pool, (at, d) in sorted(latest.items()):
        plan = d.inputs.get("plan")
        out[pool] = {
            "at": at,
            "action": d.action,
            "rule": d.rule,
            "ready_groups": d.ready_groups,
            "desired_groups": d.desired_groups,
            "planned_groups": plan["groups"] if plan else None,
            "plan_basis": plan["basis"] if plan else None,
            "predicted_latency_now_s": plan["predicted_now_s"] if plan else None,
            "predicted_latency_planned_s": plan["predicted_planned_s"] if plan else None,
        }
    return out


def status(name: str, address: str) -> dict[str, Any]:
    controller = find_controller(name, address)
    return describe(ray.get(controller.routing_view.remote(), timeout=60))


def stop(name: str, address: str, timeout_s: float = 120.0) -> dict[str, int]:
    """Stop the frontends (no new work), then the controller (it stops every group: ranks and
    placement groups), then kill them all; waits until none of its placement groups is left.
    Counts of what was stopped."""
    controller = find_controller(name, address)
    view: RoutingView = ray.get(controller.routing_view.remote(), timeout=60)
    frontends = []
    for f in view.frontends:
        try:
            frontends.append(ray.get_actor(f.name))
        except ValueError:  # already gone
            continue
    for actor in (*frontends, controller):
        try:
            ray.get(actor.stop.remote(), timeout=timeout_s)
        finally:
            ray.kill(actor)
    for leftover in rank_actors(name):  # ranks outlive their controller: none may stay behind
        with contextlib.suppress(ValueError, ray.exceptions.RayError):
            ray.kill(ray.get_actor(leftover, namespace=name))
    deadline = time.monotonic() + timeout_s
    while (left := leftover_placement_groups(name)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        raise TimeoutError(f"placement groups of {name} still exist after {timeout_s:.0f} s: {left}")
    ranks = sum(len(g.ranks) for g in view.groups if g.state not in (GroupState.STOPPED, GroupState.FAILED))
    return {"frontends": len(frontends), "ranks": ranks}


def rank_actors(name: str) -> list[str]:
    """Names of the deployment's rank actors that are alive."""
    return sorted(
        entry["name"]
        for entry in ray.util.list_named_actors(all_namespaces=True)
        if entry["namespace"] == name and parse_rank_actor_name(entry["name"]) is not None
    )


def leftover_placement_groups(name: str) -> list[str]:
    """Names of the deployment's placement groups that are not removed."""
    prefix = f"tandem-{name}-"
    return sorted(
        pg["name"]
        for pg in placement_group_table().values()
        if pg["name"].startswith(prefix) and pg["state"] != "REMOVED"
    )
