"""The Ray actor of one prefill or decode rank of a DEP group.

Lifecycle, as for the colocated rank (``cluster/rank_actor.py``): ``rendezvous_address`` (rank 0)
-> ``setup`` on every rank at once -> ``run`` (the lockstep loop; returns only when stopped or
failed) -> ``submit_jobs`` (prefill) or ``submit_requests`` (decode), ``abort``, ``collect``.
A decode rank is told the prefill ranks with ``set_prefill_ranks`` and sends them jobs directly.

Pushes leave from the loop thread at the end of an iteration, as fire-and-forget calls on named
frontend actors: a decode rank sends each frontend one :class:`StreamBatch` of its requests' new
tokens and results; a prefill rank sends each subscribed frontend its KV events
(``subscribe_kv_events`` returns the starting snapshot).
"""

from __future__ import annotations

import itertools
import logging
import threading
from dataclasses import dataclass
from typing import Any

import ray

from tandem.cluster.rank_setup import GroupRendezvous, enter_group, rank_device
from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.types import DecodeSchedulerConfig
from tandem.decode.worker import DecodeResult, DecodeWorker, PrefillDispatcher, Routing
from tandem.engine.colocated import DTYPES
from tandem.engine.dep_rank import RankRequest
from tandem.engine.prefix_cache import block_hash
from tandem.engine.request import Request, check_prompt
from tandem.engine.role_loop import RoleRankLoop
from tandem.engine.runner import ModelRunner
from tandem.engine.scheduler import admit_new_request
from tandem.kvtransfer.metadata import RayMetadataStore
from tandem.kvtransfer.nixl_transport import NixlTransport
from tandem.model.config import ModelConfig
from tandem.model.kv_pool import KVPool
from tandem.prefill.job import PrefillJob
from tandem.prefill.kv_events import KVEventBatch, KVEventPublisher
from tandem.prefill.scheduler import PrefillScheduler, PrefillSchedulerConfig
from tandem.prefill.worker import PrefillWorker

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RoleRankSpec:
    role: str  # "prefill" or "decode"
    name: str  # this rank's name for transfers and placement, e.g. "decode0-r1"
    model_dir: str
    dtype: str
    group_id: str
    incarnation: int
    rank: int
    world_size: int
    num_pages: int
    page_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    layerwise: bool = True
    kv_timeout_s: float = 30.0
    collective_timeout_s: float = 60.0


class _RayPrefillDispatcher(PrefillDispatcher):
    """The router's choice when it made one and the rank is known; otherwise (requests from no
    router, and retries) prefix affinity: a prompt with a full first page goes to the prefill rank
    its first block hash picks (so prompts that share a system prompt meet the same prefix
    cache); shorter prompts go round-robin. A job goes by a fire-and-forget call."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.ranks: dict[str, Any] = {}
        self._next = itertools.count()

    def choose(self, request: Request, preferred: str | None = None) -> str:
        if preferred is not None and preferred in self.ranks:
            return preferred
        names = sorted(self.ranks)
        if not names:
            raise RuntimeError("no prefill rank is known to this decode rank")
        prompt = request.prompt_token_ids
        if len(prompt) > self.page_size:
            return names[block_hash(None, prompt[: self.page_size]) % len(names)]
        return names[next(self._next) % len(names)]

    def send(self, prefill_rank: str, job: PrefillJob) -> None:
        self.ranks[prefill_rank].submit_jobs.remote([job])


# one thread runs the loop for good; the rest take submits, aborts and calls that wait on the loop
@ray.remote(max_concurrency=16)  # type: ignore[call-overload]
class RoleRankActor:
    def __init__(self, spec: RoleRankSpec) -> None:
        self.spec = spec
        self.device = rank_device()
        self._stop = threading.Event()
        self._loop: RoleRankLoop | None = None
        self._worker: PrefillWorker | DecodeWorker | None = None
        self._prefill_dispatcher = _RayPrefillDispatcher(spec.page_size)
        self._cfg: ModelConfig | None = None
        self._kv_events = KVEventPublisher(spec.name, spec.page_size, spec.incarnation)
        self._frontends: dict[str, Any] = {}  # name -> actor handle, for pushes
        self._last_push: dict[str, Any] = {}  # name -> the latest push's object ref
        self._rendezvous = GroupRendezvous()

    def rendezvous_address(self) -> str:
        return self._rendezvous.open(self.spec.collective_timeout_s)

    def setup(self, master: str) -> str:
        spec = self.spec
        cfg, model, dispatcher = enter_group(self._rendezvous, self.device, master, spec)
        self._cfg = cfg
        dtype = DTYPES[spec.dtype]
        pool = KVPool(cfg, spec.num_pages, spec.page_size, dtype, self.device)
        runner = ModelRunner(model, pool, lockstep=True)
        transport = NixlTransport(spec.name, spec.incarnation, pool.layout, RayMetadataStore())
        worker: PrefillWorker | DecodeWorker
        if spec.role == "prefill":
            scheduler = PrefillScheduler(
                PrefillSchedulerConfig(
                    num_pages=spec.num_pages,
                    page_size=spec.page_size,
                    max_num_seqs=spec.max_num_seqs,
                    max_num_batched_tokens=spec.max_num_batched_tokens,
                    max_model_len=cfg.max_position_embeddings,
                    vocab_size=cfg.vocab_size,
                )
            )
            worker = PrefillWorker(scheduler, runner, transport, spec.layerwise, spec.kv_timeout_s)
        else:
            decode = DecodeScheduler(
                DecodeSchedulerConfig(
                    num_pages=spec.num_pages,
                    page_size=spec.page_size,
                    max_num_seqs=spec.max_num_seqs,
                    max_model_len=cfg.max_position_embeddings,
                    kv_wait_timeout_s=spec.kv_timeout_s,
                )
            )
            worker = DecodeWorker(
                spec.name,
                spec.incarnation,
                decode,
                runner,
                transport,
                self._prefill_dispatcher,
                spec.kv_timeout_s,
            )
        self._worker = worker
        self._loop = RoleRankLoop(worker, spec.rank, dispatcher, self.device, after_iteration=self._push)
        return spec.name

    def _push(self) -> None:
        """Loop thread, end of an iteration: streams to frontends, KV events to subscribers. A
        frontend that is gone loses its requests here (aborted) and its subscription."""
        worker = self._worker
        if isinstance(worker, DecodeWorker):
            for frontend, batch in worker.take_pushes().items():
                if not self._send(frontend, "push_stream", batch):
                    worker.abort_frontend(frontend)
        elif isinstance(worker, PrefillWorker):
            for subscriber, events in self._kv_events.publish(worker.scheduler.take_events()).items():
                if not self._send(subscriber, "push_kv_events", events):
                    self._kv_events.unsubscribe(subscriber)

    def _send(self, frontend: str, method: str, payload: Any) -> bool:
        """Fire-and-forget ``frontend.method(payload)``; False when no such actor lives. The
        previous push's outcome tells whether the cached handle still reaches a live actor."""
        last = self._last_push.pop(frontend, None)
        if last is not None and ray.wait([last], timeout=0)[0]:
            try:
                ray.get(last, timeout=0)
            except ray.exceptions.RayActorError:  # dead: look the name up again (a restart?)
                self._frontends.pop(frontend, None)
            except Exception:  # the push itself failed there; the actor lives
                pass
        handle = self._frontends.get(frontend)
        if handle is None:
            try:
                handle = self._frontends[frontend] = ray.get_actor(frontend)
            except ValueError:
                return False
            except Exception as exc:  # the GCS did not answer: try again next iteration
                log.warning("rank %s: cannot look up %s: %s", self.spec.name, frontend, exc)
                return True
        try:
            self._last_push[frontend] = getattr(handle, method).remote(payload)
        except Exception:
            self._frontends.pop(frontend, None)
            return False
        return True

    def subscribe_kv_events(self, subscriber: str) -> KVEventBatch:
        """Send this prefill rank's KV events to the named actor from now on; the snapshot."""

        def subscribe(worker: Any) -> KVEventBatch:
            return self._kv_events.subscribe(subscriber, worker.scheduler.kv_cache.cached_block_hashes())

        if self.spec.role != "prefill":
            raise ValueError(f"rank {self.spec.name} is a {self.spec.role} rank: it has no KV events")
        return self._require().call(subscribe, timeout_s=30.0)

    def unsubscribe_kv_events(self, subscriber: str) -> None:
        self._require().post(lambda worker: self._kv_events.unsubscribe(subscriber))

    def set_prefill_ranks(self, ranks: dict[str, Any]) -> None:
        self._prefill_dispatcher.ranks = dict(ranks)

    def run(self) -> str:
        self._require().run(self._stop)
        return "stopped"

    def submit_jobs(self, jobs: list[PrefillJob]) -> None:
        cfg = self._config()
        for job in jobs:
            job.validate(cfg.vocab_size, cfg.max_position_embeddings, self.spec.page_size)
        self._require().post(lambda worker: worker.submit(jobs))

    def submit_requests(self, requests: list[RankRequest]) -> None:
        cfg = self._config()
        for r in requests:
            r.sampling.validate()
            check_prompt(r.prompt_token_ids, cfg.vocab_size, cfg.max_position_embeddings)
        eos = frozenset(cfg.eos_token_ids)
        built = [
            Request(r.request_id, list(r.prompt_token_ids), r.sampling, eos, cfg.max_position_embeddings)
            for r in requests
        ]
        for request in built:  # here, not on the loop thread: a bad request must not fail the rank
            admit_new_request(request, cfg.max_position_embeddings, self.spec.page_size, self.spec.num_pages)
        routing = {r.request_id: Routing(r.prefill_rank, r.frontend) for r in requests}
        self._require().post(lambda worker: worker.submit(built, routing))

    def abort(self, request_ids: list[str]) -> None:
        def abort_all(worker: Any) -> None:
            for request_id in request_ids:
                worker.abort(request_id)

        self._require().post(abort_all)

    def collect(self, timeout_s: float) -> list[DecodeResult]:
        return self._require().collect(timeout_s)

    def stats(self) -> dict[str, Any]:
        loop = self._require()
        worker = self._worker
        out: dict[str, Any] = {"name": self.spec.name, "role": self.spec.role, "steps": loop.steps}
        if isinstance(worker, PrefillWorker):
            s = worker.scheduler
            out |= {"queued": s.num_queued, "computing": s.num_computing, "transferring": s.num_transferring,
                    "free_pages": s.num_free_pages, "kv_bytes_sent": worker.stats.kv_bytes_sent,
                    "cached_pages": s.kv_cache.num_cached_pages}  # fmt: skip
        elif isinstance(worker, DecodeWorker):
            d = worker.scheduler
            out |= {"queued": d.num_queued, "waiting_for_kv": d.num_waiting_for_kv, "running": d.num_running,
                    "free_pages": d.num_free_pages}  # fmt: skip
        if worker is not None:
            out["in_flight"] = worker.transport.in_flight()
        out["total_pages"] = self.spec.num_pages
        return out

    def check_integrity(self, timeout_s: float = 30.0) -> None:
        """Page accounting, checked on the loop thread between two iterations; raises
        ``PageAccountingError`` when it does not hold."""
        self._require().call(lambda worker: worker.scheduler.check_integrity(), timeout_s)

    def stop(self) -> None:
        self._stop.set()

    def _config(self) -> ModelConfig:
        if self._cfg is None:
            raise RuntimeError(f"rank {self.spec.name} is not set up")
        return self._cfg

    def _require(self) -> RoleRankLoop:
        if self._loop is None:
            raise RuntimeError(f"rank {self.spec.name} is not set up")
        return self._loop
