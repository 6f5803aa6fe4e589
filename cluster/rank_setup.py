"""What a rank does to start, whatever its role: the group's rendezvous, its model with its
slice of the routed experts, then its role's worker in the one step loop. Only rank processes
import this module (it loads torch)."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING

import ray
import torch
import torch.distributed as dist

from tandem.engine.cpu_affinity import node_cores, pin_process
from tandem.engine.dep import ExpertParallelDispatcher, any_rank_has_work, expert_slice
from tandem.engine.rank_context import RankContext
from tandem.engine.rank_loop import RankLoop
from tandem.kvtransfer.bind_guard import is_loopback
from tandem.model.dtype_names import resolved_dtype
from tandem.model.dtypes import DTYPES
from tandem.model.family import AnyConfig, read_config
from tandem.model.fingerprint import kv_model_key
from tandem.model.loader import AnyModel, load_model

if TYPE_CHECKING:
    from tandem.cluster.outbox import ChannelOutbox
    from tandem.cluster.rank_spec import RankSpec


def pin_cores(ordinal: int, cores_per_rank: int) -> tuple[int, ...]:
    """Pin this process (every thread it has, and so every thread they start) to the
    ``ordinal``-th run of ``cores_per_rank`` of the node's cores, wrapping around; torch gets a
    thread a core. The cores it pinned to."""
    total = node_cores()
    cores = pin_process({(ordinal * cores_per_rank + j) % total for j in range(cores_per_rank)})
    torch.set_num_threads(len(cores))
    return cores


def rank_device() -> torch.device:
    """The rank's device; ranks share the node's cores, one torch thread each avoids
    oversubscription."""
    torch.set_num_threads(int(os.environ.get("TANDEM_RANK_THREADS", "1")))
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class GroupRendezvous:
    """A DEP group's torch.distributed rendezvous. Rank 0 opens the group's store on a port the
    OS gives it and keeps it bound, so no other process can take the port between choosing it
    and the group joining; every rank then joins through it.

    Every socket the group opens is on its node's address (loopback on an embedded Ray): the
    store's listener is bound here and handed to torch (which would otherwise listen on every
    interface), gloo's pairs bind that address, and NCCL's bootstrap takes the loopback
    interface when the node's address is loopback (unless ``NCCL_SOCKET_IFNAME`` is set)."""

    def __init__(self) -> None:
        self._store: dist.TCPStore | None = None

    def open(self, timeout_s: float) -> str:
        """Rank 0: bind the store and return its ``host:port`` for the other ranks."""
        if self._store is None:
            host = ray.util.get_node_ip_address()
            listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
            listener.bind((host, 0))
            listener.listen(1024)
            port = listener.getsockname()[1]
            self._store = dist.TCPStore(
                host,
                port,
                is_master=True,
                wait_for_workers=False,
                timeout=timedelta(seconds=timeout_s),
                master_listen_fd=listener.detach(),  # the store owns the socket from here on
            )
        return f"{self._store.host}:{self._store.port}"

    def join(self, device: torch.device, master: str, rank: int, world_size: int, timeout_s: float) -> None:
        timeout = timedelta(seconds=timeout_s)
        store = self._store
        if store is None:
            host, _, port = master.rpartition(":")
            store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
        node = ray.util.get_node_ip_address()
        options = None
        if device.type == "cuda":
            if is_loopback(node):
                os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
        else:
            options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=node)]
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            store=store,
            rank=rank,
            world_size=world_size,
            timeout=timeout,
            pg_options=options,
        )


def load_rank_model(
    model_dir: str, dtype: str, device: torch.device, rank: int, world_size: int, mtp: bool = False
) -> tuple[AnyConfig, AnyModel, ExpertParallelDispatcher]:
    """The model (either family) with this rank's share of the routed experts (others are never
    read), and with ``mtp`` its multi-token-prediction layer (the same share of its experts)."""
    cfg = read_config(Path(model_dir))
    dispatcher = ExpertParallelDispatcher(rank, world_size, cfg.n_routed_experts)
    experts = expert_slice(cfg.n_routed_experts, rank, world_size)
    model = load_model(model_dir, DTYPES[dtype], device, experts=experts, dispatcher=dispatcher, mtp=mtp)
    return model.cfg, model, dispatcher


def start_rank(
    spec: RankSpec, rendezvous: GroupRendezvous, device: torch.device, master: str, outbox: ChannelOutbox
) -> RankLoop:
    """Join the group through ``master``, load this rank's model, build its role's worker and
    the loop that will step it."""
    rank = spec.rank_id.rank
    dtype = resolved_dtype(spec.dtype, on_gpu=device.type == "cuda")
    rendezvous.join(device, master, rank, spec.world_size, spec.collective_timeout_s)
    cfg, model, dispatcher = load_rank_model(
        spec.model_dir, dtype, device, rank, spec.world_size, spec.role.uses_mtp
    )
    ctx = RankContext(
        spec.rank_id,
        spec.incarnation,
        cfg,
        model,
        dispatcher,
        device,
        DTYPES[dtype],
        outbox,
        model_key=kv_model_key(spec.model_dir, model.ops.name),
        model_dir=spec.model_dir,
        node_address=ray.util.get_node_ip_address(),
    )
    worker = spec.role.build(ctx)

    def agree(has_work: bool) -> bool:
        return any_rank_has_work(has_work, dispatcher.group, device)

    return RankLoop(worker, spec.rank_id.name, agree, spec.role.idle_wait_s)
