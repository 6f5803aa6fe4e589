"""What every rank actor does to start: the group's rendezvous, and its model with its slice of
the routed experts."""

from __future__ import annotations

import socket
from datetime import timedelta

import ray
import torch
import torch.distributed as dist

from engine.colocated import DTYPES
from engine.dep import ExpertParallelDispatcher, expert_slice
from model.checkpoint import load_checkpoint
from model.config import ModelConfig
from model.deepseek import DeepseekV3


def rendezvous_address() -> str:
    """``host:port`` for a group's torch.distributed rendezvous, on this (rank 0's) node."""
    host = ray.util.get_node_ip_address()
    with socket.socket() as s:
        s.bind((host, 0))
        port = s.getsockname()[1]
    return f"{host}:{port}"


def join_group(device: torch.device, master: str, rank: int, world_size: int, timeout_s: float) -> None:
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://{master}",
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout_s),
    )


def load_rank_model(
    model_dir: str, dtype: str, device: torch.device, rank: int, world_size: int
) -> tuple[ModelConfig, DeepseekV3, ExpertParallelDispatcher]:
    """The model with this rank's share of the routed experts (others are never read)."""
    cfg = ModelConfig.from_dir(model_dir)
    dispatcher = ExpertParallelDispatcher(rank, world_size, cfg.n_routed_experts)
    experts = expert_slice(cfg.n_routed_experts, rank, world_size)
    model = DeepseekV3(cfg, DTYPES[dtype], device, experts=experts, dispatcher=dispatcher)
    model.load_weights(load_checkpoint(model_dir, cfg, DTYPES[dtype], expert_filter=model.owns_expert))
    return cfg, model, dispatcher
