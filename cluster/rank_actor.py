"""The Ray actor of one rank of a colocated DEP group.

Lifecycle, driven by :class:`cluster.dep_group.DEPGroup`: ``rendezvous_address`` (rank 0 only)
-> ``setup`` on every rank at once (torch.distributed rendezvous, then the model with this rank's
slice of the experts) -> ``run`` (the step loop; returns only when stopped or failed, so the
group watches it to learn of a death) -> ``submit`` / ``collect`` / ``abort`` while it runs.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass

import ray
import torch

from cluster.rank_setup import GroupRendezvous, load_rank_model
from engine.colocated import ColocatedEngine, EngineConfig
from engine.dep_rank import DEPRankLoop, FinishedRequest, RankRequest, RankStats


@dataclass(frozen=True)
class RankSpec:
    model_dir: str
    dtype: str
    group_id: str
    incarnation: int
    rank: int
    world_size: int
    engine: EngineConfig
    collective_timeout_s: float = 60.0


class RankNotReady(RuntimeError):
    pass


@ray.remote(max_concurrency=4)  # type: ignore[call-overload]
class DEPRankActor:
    def __init__(self, spec: RankSpec) -> None:
        self.spec = spec
        # ranks share the node's cores; one thread each avoids oversubscription
        torch.set_num_threads(int(os.environ.get("TANDEM_RANK_THREADS", "1")))
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self._stop = threading.Event()
        self._loop: DEPRankLoop | None = None
        self._rendezvous = GroupRendezvous()

    def rendezvous_address(self) -> str:
        return self._rendezvous.open(self.spec.collective_timeout_s)

    def setup(self, master: str) -> int:
        spec = self.spec
        self._rendezvous.join(self.device, master, spec.rank, spec.world_size, spec.collective_timeout_s)
        _, model, dispatcher = load_rank_model(
            spec.model_dir, spec.dtype, self.device, spec.rank, spec.world_size
        )
        engine = ColocatedEngine(model, spec.engine, lockstep=True)
        self._loop = DEPRankLoop(engine, spec.rank, dispatcher)
        return len(dispatcher.local)

    def run(self) -> str:
        loop = self._require()
        loop.run(self._stop)
        return "stopped"

    def submit(self, requests: list[RankRequest]) -> None:
        self._require().submit(requests)

    def abort(self, request_ids: list[str]) -> None:
        self._require().abort(request_ids)

    def collect(self, timeout_s: float) -> list[FinishedRequest]:
        return self._require().collect(timeout_s)

    def stats(self) -> RankStats:
        return self._require().stats()

    def check_integrity(self) -> None:
        self._require().engine.scheduler.check_integrity()

    def stop(self) -> None:
        self._stop.set()

    def _require(self) -> DEPRankLoop:
        if self._loop is None:
            raise RankNotReady(f"rank {self.spec.rank} of group {self.spec.group_id} is not set up")
        return self._loop
