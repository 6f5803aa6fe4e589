"""The memory plan: each rank's weights, workspace and KV pages, and serve sizing pools by it."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray

from tandem.cli.main import main
from tandem.cluster.memory_plan import (
    GIB,
    MemoryPlanError,
    kv_page_bytes,
    plan_memory,
    sized_topology,
    workspace_bytes,
)
from tandem.cluster.placement import RankResources
from tandem.cluster.pools import Cluster
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import SpeculativeSpec, Topology, TopologyError
from tandem.engine.role_spec import PooledRole
from tandem.model.config import ModelConfig
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.model.rank_weights import rank_weight_bytes
from tandem.wire.messages import Role

DEEPSEEK_V3 = Path(__file__).resolve().parents[2] / "deploy" / "models" / "deepseek-v3"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("plan") / "tiny", seed=0, num_nextn_predict_layers=1)


def test_each_rank_gets_what_is_left_in_whole_pages(tiny: Path) -> None:
    cfg = ModelConfig.from_dir(tiny)
    topology = Topology.model_validate({"prefill": {"dep": 3, "page_size": 16}, "decode": {"dep": 2}})
    plan = plan_memory(topology, cfg, "float32", gpu_memory_gib=0.05, utilization=0.8)
    assert [(r.role, r.group, r.rank) for r in plan.ranks] == [
        (Role.PREFILL, "prefill0", 0), (Role.PREFILL, "prefill0", 1), (Role.PREFILL, "prefill0", 2),
        (Role.DECODE, "decode0", 0), (Role.DECODE, "decode0", 1),
    ]  # fmt: skip
    usable = int(0.05 * GIB * 0.8)
    assert plan.usable_bytes == usable
    for r in plan.ranks:
        dep = 3 if r.role is Role.PREFILL else 2
        assert r.weight_bytes == rank_weight_bytes(cfg, "float32", r.rank, dep).total_bytes
        # 3 layers x page_size x (kv_lora_rank 32 + rope 8) x 4 bytes
        assert r.kv_page_bytes == 3 * (16 if r.role is Role.PREFILL else 64) * 40 * 4
        left = usable - r.weight_bytes - r.workspace_bytes
        assert r.kv_pages * r.kv_page_bytes <= left < (r.kv_pages + 1) * r.kv_page_bytes
        # the whole context of 2048 tokens: its last token's KV is never computed
        assert r.request_pages == -(-2047 // r.page_size) and r.fits
    # 16 experts on 3 ranks: 6, 5, 5; the rank with one more expert has fewer pages
    prefill = [r for r in plan.ranks if r.role is Role.PREFILL]
    assert prefill[0].weight_bytes > prefill[1].weight_bytes == prefill[2].weight_bytes
    assert plan.pool_pages(Role.PREFILL) == prefill[0].kv_pages < prefill[1].kv_pages
    assert plan.fits


def test_mtp_drafts_add_the_layer_to_weights_and_pages(tiny: Path) -> None:
    cfg = ModelConfig.from_dir(tiny)
    plain = Topology()
    mtp = plain.model_copy(update={"speculative": SpeculativeSpec(tokens=2, drafter="mtp")})
    a, b = (plan_memory(t, cfg, "float32", 0.05) for t in (plain, mtp))
    for before, after in zip(a.ranks, b.ranks, strict=True):
        assert after.kv_page_bytes * 3 == before.kv_page_bytes * 4  # 3 decoder layers + MTP
        assert after.weight_bytes == rank_weight_bytes(cfg, "float32", after.rank, 2, mtp=True).total_bytes
        assert after.weight_bytes > before.weight_bytes
    # a decode step verifies each request's row and its 2 drafts: three times the rows
    assert b.ranks[-1].workspace_bytes > a.ranks[-1].workspace_bytes
    assert kv_page_bytes(cfg, "bfloat16", 64, mtp=True) == 4 * 64 * 40 * 2


def test_workspace_grows_with_the_step_and_counts_the_rope_table() -> None:
    cfg = ModelConfig.from_dir(DEEPSEEK_V3)
    rope_table = 163840 * 64 * 4
    assert workspace_bytes(cfg, "bfloat16", 0, 0) == rope_table
    one, two = workspace_bytes(cfg, "bfloat16", 1, 0), workspace_bytes(cfg, "bfloat16", 2, 0)
    # a row: hidden and residual, then the MoE layer's 8 routed copies (the largest intermediate)
    assert two - one == one - rope_table == (2 * 7168 + 8 * 3 * (7168 + 2048) + 3 * 2048) * 2
    assert workspace_bytes(cfg, "bfloat16", 0, 1) - rope_table == 129280 * (2 + 8)


def test_deepseek_v3_on_h200s_needs_decode_groups_of_8_or_more() -> None:
    cfg = ModelConfig.from_dir(DEEPSEEK_V3)
    plans = {p: plan_memory(Topology.preset(p), cfg, "bfloat16", 141) for p in ("dep16-dep2", "dep16-dep8")}
    assert not plans["dep16-dep2"].fits and plans["dep16-dep8"].fits
    misfits = plans["dep16-dep2"].misfits()
    assert {(r.role, r.kv_pages) for r in misfits} == {(Role.DECODE, 0)} and len(misfits) == 2
    prefill = [r for r in plans["dep16-dep8"].ranks if r.role is Role.PREFILL]
    assert len(prefill) == 16 and len({r.kv_pages for r in prefill}) == 1
    # 61 layers x 64 tokens x 576 numbers x 2 bytes; the whole context is 2560 pages
    assert prefill[0].kv_page_bytes == 4_497_408 and prefill[0].request_pages == 2560


def test_colocated_pools_are_planned_as_the_controller_names_them(tiny: Path) -> None:
    plan = plan_memory(Topology.preset("colocated"), ModelConfig.from_dir(tiny), "float32", 0.05)
    assert [r.group for r in plan.ranks] == ["colocated0", "colocated0", "colocated1", "colocated1"]
    assert {r.role for r in plan.ranks} == {Role.COLOCATED}


def test_gpu_memory_fields_are_validated() -> None:
    assert Topology().gpu_memory_gib is None and Topology().gpu_memory_utilization == 0.9
    for bad in ({"gpu_memory_gib": 0}, {"gpu_memory_utilization": 1.5}):
        with pytest.raises(ValueError):
            Topology.model_validate(bad)


def test_without_gpu_memory_the_pools_keep_their_pages(tiny: Path) -> None:
    topology = Topology.preset("local")
    assert sized_topology(topology, ModelConfig.from_dir(tiny), "float32") is topology


def test_serve_sizes_every_pool_from_the_plan(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The roles the controller builds hold the plan's pages, not the topology's ``num_pages``."""
    topology = Topology.model_validate(
        {"gpu_memory_gib": 0.05, "prefill": {"dep": 3, "num_pages": 7}, "decode": {"num_pages": 9}}
    )
    server = Server(ServeOptions(topology=topology, model_dir=tiny))
    planned = server.planned_topology()
    # serve's default dtype, auto, is a GPU's in a topology sized by GPU memory
    assert server.rank_dtype == "bfloat16"
    plan = plan_memory(topology, ModelConfig.from_dir(tiny), "bfloat16", 0.05)
    pages = plan.pool_pages(Role.PREFILL), plan.pool_pages(Role.DECODE)
    assert (planned.prefill.num_pages, planned.decode.num_pages) == pages
    assert min(pages) > 9  # far more than the topology gave
    monkeypatch.setattr(RankResources, "detect", staticmethod(lambda cpus_per_rank=0.1: RankResources()))
    cluster = Cluster(planned, str(tiny))
    roles = [g.config.role for g in cluster.groups]
    assert all(isinstance(r, PooledRole) for r in roles)
    assert [(r.role, r.num_pages) for r in roles if isinstance(r, PooledRole)] == [
        (Role.PREFILL, pages[0]),
        (Role.DECODE, pages[1]),
    ]
    assert not ray.is_initialized()


def test_serve_refuses_a_rank_that_cannot_hold_the_model(tiny: Path) -> None:
    topology = Topology.model_validate({"gpu_memory_gib": 0.001})
    with pytest.raises(MemoryPlanError) as refused:
        Server(ServeOptions(topology=topology, model_dir=tiny)).start()
    assert isinstance(refused.value, TopologyError)
    message = str(refused.value)
    assert message.startswith("gpu_memory_gib: rank prefill0/0 (prefill) cannot hold the model")
    assert "\n" not in message and "0 KV pages" in message and "needs 32" in message
    assert not ray.is_initialized()  # refused before Ray, the controller or any rank started


def test_serve_command_refuses_in_one_line(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "small.yaml"
    path.write_text("gpu_memory_gib: 0.001\n")
    code = main(["serve", "--topology", str(path), "--model", str(tiny), "--port", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("tandem: error: gpu_memory_gib: rank prefill0/0") and err.count("\n") == 1
    assert not ray.is_initialized()
