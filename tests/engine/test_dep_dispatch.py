"""Expert-parallel MoE over gloo in separate processes equals the one-process MoE layer."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.engine.dep import ExpertParallelDispatcher, any_rank_has_work, expert_slice
from tandem.model.config import ModelConfig
from tandem.model.expert_dispatch import LocalExperts
from tandem.model.kernels.backend import get_backend
from tandem.model.layers import MoE
from tandem.model.make_tiny import tiny_config_dict

WORLD = 4
# tokens per rank: uneven, one rank idle
TOKENS = [5, 0, 1, 9]


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


def _inputs(cfg: ModelConfig) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(n, cfg.hidden_size, generator=gen, dtype=torch.float64) for n in TOKENS]


def _rank(rank: int, out_dir: str) -> None:
    # a file rendezvous: no port to race other processes for
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=WORLD)
    cfg = ModelConfig.from_dict(tiny_config_dict())
    experts = expert_slice(cfg.n_routed_experts, rank, WORLD)
    moe = _moe(cfg, experts, _weights(cfg))
    dispatcher = ExpertParallelDispatcher(rank, WORLD, cfg.n_routed_experts)
    x = _inputs(cfg)[rank]
    out = moe(x, get_backend("cpu", "torch"), dispatcher)
    flags = [any_rank_has_work(rank == 2), any_rank_has_work(False)]
    torch.save({"out": out, "flags": flags, "sent": dispatcher.stats.rows_sent}, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


def test_expert_parallel_equals_one_process(tmp_path: Path) -> None:
    mp.spawn(_rank, args=(str(tmp_path),), nprocs=WORLD)
    cfg = ModelConfig.from_dict(tiny_config_dict())
    moe = _moe(cfg, range(cfg.n_routed_experts), _weights(cfg))
    for rank, x in enumerate(_inputs(cfg)):
        result = torch.load(tmp_path / f"{rank}.pt")
        expected = moe(x, get_backend("cpu", "torch"), LocalExperts())
        assert result["out"].shape == (TOKENS[rank], cfg.hidden_size)
        torch.testing.assert_close(result["out"], expected, rtol=1e-12, atol=1e-12)
        assert result["flags"] == [True, False]
        assert result["sent"] == TOKENS[rank] * cfg.num_experts_per_tok
