"""What every rank actor does to start: the group's rendezvous, and its model with its slice of
the routed experts."""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Protocol

import ray
import torch
import torch.distributed as dist

from tandem.engine.colocated import DTYPES
from tandem.engine.dep import ExpertParallelDispatcher, expert_slice
from tandem.model.checkpoint import load_checkpoint
from tandem.model.config import ModelConfig
from tandem.model.deepseek import DeepseekV3


class RankPlace(Protocol):
    """Where a rank stands: its group's model and its place in the group (both rank specs)."""

    @property
    def model_dir(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def rank(self) -> int: ...
    @property
    def world_size(self) -> int: ...
    @property
    def collective_timeout_s(self) -> float: ...


def rank_device() -> torch.device:
    """The rank's device; ranks share the node's cores, one torch thread each avoids
    oversubscription."""
    torch.set_num_threads(int(os.environ.get("TANDEM_RANK_THREADS", "1")))
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class GroupRendezvous:
    """A DEP group's torch.distributed rendezvous. Rank 0 opens the group's store on a port the
    OS gives it and keeps it bound, so no other process can take the port between choosing it
    and the group joining; every rank then joins through it."""

    def __init__(self) -> None:
        self._store: dist.TCPStore | None = None

    def open(self, timeout_s: float) -> str:
        """Rank 0: bind the store and return its ``host:port`` for the other ranks."""
        if self._store is None:
            host = ray.util.get_node_ip_address()
            self._store = dist.TCPStore(
                host, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
            )
        return f"{self._store.host}:{self._store.port}"

    def join(self, device: torch.device, master: str, rank: int, world_size: int, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        store = self._store
        if store is None:
            host, _, port = master.rpartition(":")
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
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


def enter_group(
    rendezvous: GroupRendezvous, device: torch.device, master: str, place: RankPlace
) -> tuple[ModelConfig, DeepseekV3, ExpertParallelDispatcher]:
    """Join the group through ``master``, then load this rank's model."""
    rendezvous.join(device, master, place.rank, place.world_size, place.collective_timeout_s)
    return load_rank_model(place.model_dir, place.dtype, device, place.rank, place.world_size)
