"""Expert-parallel MoE over gloo in separate processes equals the one-process MoE layer, whether
the experts split evenly over the group or not (12 experts over 16 ranks: four hold none)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.engine.dep import ExpertParallelDispatcher, any_rank_has_work, expert_slice
from tandem.engine.host_sync import HostSyncError, no_host_sync
from tandem.model.config import ModelConfig
from tandem.model.expert_dispatch import LocalExperts
from tandem.model.kernels.registry import get_backend
from tandem.model.layers import MoE
from tandem.model.make_tiny import tiny_config_dict

# (ranks, routed experts, tokens per rank): uneven tokens, one rank idle
CASES = {
    "even": (4, 16, [5, 0, 1, 9]),
    "uneven": (3, 16, [4, 7, 0]),
    "12-experts-on-dep16": (16, 12, [3, 0, 1, 6, 2, 0, 5, 1, 4, 2, 0, 3, 7, 1, 2, 5]),
}


def _moe(cfg: ModelConfig, experts: range, full: dict[str, torch.Tensor]) -> MoE:
    moe = MoE(cfg, torch.float64, "cpu", experts.start, len(experts))
    with torch.no_grad():
        moe.gate_weight.copy_(full["gate"])
        moe.e_score_correction_bias.copy_(full["bias"])
        moe.w_gate_up.copy_(full["w13"][experts.start : experts.stop])
        moe.w_down.copy_(full["w2"][experts.start : experts.stop])
        assert moe.shared_experts is not None
        for name, p in moe.shared_experts.named_parameters():
            p.copy_(full[name])
    return moe


def _weights(cfg: ModelConfig) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    e, h, i = cfg.n_routed_experts, cfg.hidden_size, cfg.moe_intermediate_size
    shared = i * cfg.n_shared_experts
    return {
        "gate": torch.randn(e, h, generator=gen),
        "bias": 0.1 * torch.randn(e, generator=gen),
        "w13": torch.randn(e, 2 * i, h, generator=gen, dtype=torch.float64) / h**0.5,
        "w2": torch.randn(e, h, i, generator=gen, dtype=torch.float64) / i**0.5,
        "gate_proj.weight": torch.randn(shared, h, generator=gen, dtype=torch.float64) / h**0.5,
        "up_proj.weight": torch.randn(shared, h, generator=gen, dtype=torch.float64) / h**0.5,
        "down_proj.weight": torch.randn(h, shared, generator=gen, dtype=torch.float64) / shared**0.5,
    }


def _config(experts: int) -> ModelConfig:
    return ModelConfig.from_dict({**tiny_config_dict(), "n_routed_experts": experts})


def _inputs(cfg: ModelConfig, tokens: list[int]) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(n, cfg.hidden_size, generator=gen, dtype=torch.float64) for n in tokens]


def _rank(rank: int, out_dir: str, case: str) -> None:
    world, num_experts, tokens = CASES[case]
    # a file rendezvous: no port to race other processes for
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=world)
    cfg = _config(num_experts)
    experts = expert_slice(cfg.n_routed_experts, rank, world)
    moe = _moe(cfg, experts, _weights(cfg))
    dispatcher = ExpertParallelDispatcher(rank, world, cfg.n_routed_experts)
    x = _inputs(cfg, tokens)[rank]
    out = moe(x, get_backend("cpu", "torch"), dispatcher)
    flags = [any_rank_has_work(rank == 2), any_rank_has_work(False)]
    received = dispatcher.stats.rows_received
    sent = dispatcher.stats.rows_sent
    with dispatcher.fixed_capacity(max(tokens)):  # a static step: every rank at the largest batch
        fixed = moe(x, get_backend("cpu", "torch"), dispatcher)
    torch.save(
        {"out": out, "fixed": fixed, "flags": flags, "sent": sent, "received": received},
        f"{out_dir}/{rank}.pt",
    )
    dist.destroy_process_group()


@pytest.mark.parametrize("case", sorted(CASES))
def test_expert_parallel_equals_one_process(tmp_path: Path, case: str) -> None:
    world, num_experts, tokens = CASES[case]
    mp.spawn(_rank, args=(str(tmp_path), case), nprocs=world)
    cfg = _config(num_experts)
    moe = _moe(cfg, range(cfg.n_routed_experts), _weights(cfg))
    received = 0
    for rank, x in enumerate(_inputs(cfg, tokens)):
        result = torch.load(tmp_path / f"{rank}.pt")
        expected = moe(x, get_backend("cpu", "torch"), LocalExperts())
        assert result["out"].shape == (tokens[rank], cfg.hidden_size)
        torch.testing.assert_close(result["out"], expected, rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(result["fixed"], expected, rtol=1e-12, atol=1e-12)
        assert result["flags"] == [True, False]
        assert result["sent"] == tokens[rank] * cfg.num_experts_per_tok
        received += result["received"]
        if not expert_slice(num_experts, rank, world):  # a rank without experts computes none
            assert result["received"] == 0
    assert received == sum(tokens) * cfg.num_experts_per_tok


def test_expert_slices_cover_every_expert_once_and_differ_by_at_most_one() -> None:
    for experts, world in [(16, 4), (16, 3), (12, 16), (256, 144), (256, 320), (7, 1)]:
        slices = [expert_slice(experts, r, world) for r in range(world)]
        assert [e for s in slices for e in s] == list(range(experts))
        assert max(map(len, slices)) - min(map(len, slices)) <= 1
    assert [len(expert_slice(256, r, 144)) for r in (0, 111, 112, 143)] == [2, 2, 1, 1]
    with pytest.raises(ValueError, match="rank 4"):
        expert_slice(16, 4, 4)


def _one_rank(rank: int, out_dir: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=0, world_size=1)
    cfg = _config(16)
    moe = _moe(cfg, range(cfg.n_routed_experts), _weights(cfg))
    dispatcher = ExpertParallelDispatcher(0, 1, cfg.n_routed_experts)
    x = _inputs(cfg, [7])[0]
    out = moe(x, get_backend("cpu", "torch"), dispatcher)
    flags = [any_rank_has_work(True), any_rank_has_work(False)]
    torch.save({"out": out, "flags": flags, "exchanged": dispatcher.stats.layers}, f"{out_dir}/0.pt")
    dist.destroy_process_group()


def test_a_group_of_one_computes_its_experts_in_place_without_a_collective(tmp_path: Path) -> None:
    """The same arithmetic as one process without a group (bit for bit), no all-to-all, and the
    step agreement answers the rank's own flag."""
    mp.spawn(_one_rank, args=(str(tmp_path),), nprocs=1)
    cfg = _config(16)
    moe = _moe(cfg, range(cfg.n_routed_experts), _weights(cfg))
    expected = moe(_inputs(cfg, [7])[0], get_backend("cpu", "torch"), LocalExperts())
    result = torch.load(tmp_path / "0.pt")
    assert torch.equal(result["out"], expected)
    assert result["flags"] == [True, False] and result["exchanged"] == 0


def _guarded_rank(rank: int, out_dir: str) -> None:
    """Two ranks with the Triton expert kernels (the GPU's path): a fixed-capacity exchange reads
    nothing back to the host; the split exchange does, and the guard says where."""
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=2)
    cfg = _config(16)
    experts = expert_slice(cfg.n_routed_experts, rank, 2)
    moe = _moe(cfg, experts, _weights(cfg)).float()
    dispatcher = ExpertParallelDispatcher(rank, 2, cfg.n_routed_experts)
    x = _inputs(cfg, [5, 3])[rank].float()
    ops = get_backend("cpu", "triton")
    with dispatcher.fixed_capacity(5), no_host_sync(torch.device("cpu")):
        fixed = moe(x, ops, dispatcher)
    caught = ""
    try:
        with no_host_sync(torch.device("cpu")):
            moe(x, ops, dispatcher)
    except HostSyncError as error:
        caught = error.where
    # the other rank still waits in the split exchange's first all-to-all: finish it unguarded
    if caught:
        split = moe(x, ops, dispatcher)
    torch.save({"fixed": fixed, "split": split, "caught": caught}, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


def test_a_fixed_capacity_exchange_never_reads_the_device_on_the_host(tmp_path: Path) -> None:
    mp.spawn(_guarded_rank, args=(str(tmp_path),), nprocs=2)
    for rank in range(2):
        result = torch.load(tmp_path / f"{rank}.pt")
        assert result["caught"].startswith("engine/dep.py:"), result["caught"]
        torch.testing.assert_close(result["fixed"], result["split"], rtol=1e-5, atol=1e-5)
