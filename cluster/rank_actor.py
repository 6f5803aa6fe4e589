"""The Ray actor of one rank of a colocated DEP group.

Lifecycle, driven by :class:`cluster.dep_group.DEPGroup`: ``rendezvous_address`` (rank 0 only)
-> ``setup`` on every rank at once (torch.distributed rendezvous, then the model with this rank's
slice of the experts) -> ``run`` (the step loop; returns only when stopped or failed, so the
group watches it to learn of a death) -> ``submit`` / ``collect`` / ``abort`` while it runs.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import ray

from tandem.cluster.rank_setup import GroupRendezvous, enter_group, rank_device
from tandem.engine.colocated import ColocatedEngine, EngineConfig
from tandem.engine.dep_rank import DEPRankLoop, FinishedRequest, RankRequest, RankStats


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
        self.device = rank_device()
        self._stop = threading.Event()
        self._loop: DEPRankLoop | None = None
        self._rendezvous = GroupRendezvous()

    def rendezvous_address(self) -> str:
        return self._rendezvous.open(self.spec.collective_timeout_s)

    def setup(self, master: str) -> int:
        spec = self.spec
        _, model, dispatcher = enter_group(self._rendezvous, self.device, master, spec)
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
