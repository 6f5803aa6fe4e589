"""Node roles by label: each pool's selector under each ``unlabelled_nodes`` mode, and the dry-run
plan (packing, spanning nodes, and why a group fits nowhere)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.cluster.node_roles import NodeInfo, admits, label_selector, plan
from tandem.cluster.topology import PlacementSpec, PoolSpec, Topology, TopologyError
from tandem.wire.messages import Role

KEY = "tandem.io/role"
GPU_RANK = {"GPU": 1.0, "CPU": 1.0}


def _node(name: str, role: str | None, gpus: float = 8, cpus: float = 64) -> NodeInfo:
    return NodeInfo(name, f"10.0.0.{len(name)}", {KEY: role} if role else {}, {"GPU": gpus, "CPU": cpus})


HEAD, BARE = _node("head", None, gpus=0), _node("bare", None)
PREFILL, DECODE = _node("prefill-a", "prefill"), _node("decode-a", "decode")


@pytest.mark.parametrize(
    ("mode", "nodes", "role", "admitted"),
    [
        # auto: roles are strict once a node carries a role label ...
        ("auto", [HEAD, PREFILL, DECODE], Role.PREFILL, {"prefill-a"}),
        ("auto", [HEAD, PREFILL, DECODE], Role.DECODE, {"decode-a"}),
        # ... even while every node of one role is lost (the group waits for one) ...
        ("auto", [HEAD, PREFILL], Role.DECODE, set()),
        # ... and an unlabelled cluster takes both roles anywhere
        ("auto", [HEAD, BARE], Role.DECODE, {"head", "bare"}),
        ("any", [BARE, PREFILL, DECODE], Role.PREFILL, {"bare", "prefill-a"}),
        ("never", [BARE, DECODE], Role.PREFILL, set()),
    ],
)
def test_the_selector_admits_the_nodes_of_the_role(
    mode: str, nodes: list[NodeInfo], role: Role, admitted: set[str]
) -> None:
    spec = PlacementSpec(unlabelled_nodes=mode)  # type: ignore[arg-type]
    selector = label_selector(spec, role, nodes)
    assert {n.node_id for n in nodes if admits(selector, n)} == admitted


def test_labels_of_the_topology_are_used() -> None:
    spec = PlacementSpec(label_key="example.com/pool", prefill_label="p", decode_label="d")
    nodes = [NodeInfo("x", "h", {"example.com/pool": "d"}, {"CPU": 1})]
    assert label_selector(spec, Role.DECODE, nodes) == {"example.com/pool": "d"}
    assert label_selector(spec, Role.PREFILL, nodes) == {"example.com/pool": "p"}
    anywhere = spec.model_copy(update={"unlabelled_nodes": "any"})
    assert label_selector(anywhere, Role.PREFILL, nodes) == {"example.com/pool": "!d"}


def test_a_topology_with_one_label_for_both_roles_is_refused() -> None:
    with pytest.raises(ValueError, match="decode_label: 'x' is the prefill_label too"):
        PlacementSpec(prefill_label="x", decode_label="x")


def test_a_misspelt_placement_field_names_it(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("placement:\n  unlabeled_nodes: any\n")
    with pytest.raises(TopologyError, match=r"placement\.unlabeled_nodes: Extra inputs are not permitted"):
        Topology.load(path)


def test_the_plan_packs_each_group_and_spans_nodes_when_one_is_too_small() -> None:
    topology = Topology(prefill=PoolSpec(groups=1, dep=16), decode=PoolSpec(groups=3, dep=2))
    nodes = [
        HEAD,
        _node("prefill-a", "prefill"),
        _node("prefill-b", "prefill"),
        _node("decode-a", "decode", 4),
    ]
    plans = plan(topology, nodes, GPU_RANK)
    by_group = {p.group_id: p for p in plans}
    assert [n.node_id for n in by_group["prefill0"].nodes] == ["prefill-a"] * 8 + ["prefill-b"] * 8
    assert [n.node_id for n in by_group["decode0"].nodes] == ["decode-a", "decode-a"]
    assert [n.node_id for n in by_group["decode1"].nodes] == ["decode-a", "decode-a"]
    # the decode node's four GPUs are taken: the third DEP2 group fits nowhere, and says so
    assert by_group["decode2"].problem is not None and not by_group["decode2"].nodes
    assert "needs 2 bundles of {'GPU': 1.0, 'CPU': 1.0}" in by_group["decode2"].problem
    assert "decode-a has {CPU: 60, GPU: 0}" in by_group["decode2"].problem
    assert (
        by_group["decode2"]
        .describe()
        .startswith("decode2 (decode, nodes tandem.io/role=decode): cannot be placed")
    )


def test_a_group_sees_the_room_earlier_groups_took() -> None:
    """The roomiest node (by CPU) is tried first; once a group fills it, the next group goes to
    the other node."""
    topology = Topology(prefill=PoolSpec(groups=1, dep=1), decode=PoolSpec(groups=2, dep=2))
    small, roomy = _node("decode-a", "decode", gpus=2, cpus=32), _node("decode-b", "decode", gpus=2, cpus=64)
    plans = {p.group_id: p for p in plan(topology, [PREFILL, small, roomy], GPU_RANK)}
    assert [n.node_id for n in plans["decode0"].nodes] == ["decode-b", "decode-b"]
    assert [n.node_id for n in plans["decode1"].nodes] == ["decode-a", "decode-a"]


def test_a_role_with_no_node_says_so() -> None:
    topology = Topology(placement=PlacementSpec(unlabelled_nodes="never"))
    plans = plan(topology, [BARE, PREFILL], GPU_RANK)
    decode = next(p for p in plans if p.role is Role.DECODE)
    assert decode.problem == (
        "needs 2 bundles of {'GPU': 1.0, 'CPU': 1.0}; no live node has the label (of 2 nodes)"
    )
    prefill = next(p for p in plans if p.role is Role.PREFILL)
    assert prefill.problem is None and prefill.describe().endswith("rank 1 on prefill-a (10.0.0.9)")
