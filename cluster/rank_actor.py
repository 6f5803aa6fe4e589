"""The Ray actor of one rank of a DEP group, for every role: prefill, decode or colocated.

Lifecycle, driven by :class:`tandem.cluster.group.RankGroup`: ``rendezvous_address`` (rank 0)
-> ``setup`` on every rank at once (torch.distributed rendezvous, the model with this rank's
slice of the experts, the role's worker) -> ``run`` (the lockstep loop; it returns only when
stopped or failed, so the group watches it to learn of a death) -> ``submit``, ``abort``,
``collect`` and the rest while it runs. A frontend submits, aborts and receives its streams
over a channel it opens to the rank (``channel_endpoint``, ``cluster/channel_server.py``); the
actor's ``submit``, ``abort`` and ``collect`` drive a group without frontends (benches, tests)
and carry a decode rank's prefill jobs.

The shell knows no role: what a rank does lives in its worker (``prefill/``, ``decode/``, the
colocated engine), built from ``RankSpec.role``. Items a caller submits are checked on the
caller's thread (``worker.admit``: a bad request fails alone, never the rank), then run on the
loop thread: every message a rank receives is one of ``wire/rank_inbox.py`` on its loop's one
inbox. This module stays free of torch: the processes that start ranks import it.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from pathlib import Path
from typing import Any

import ray

from tandem.cluster.channel_server import ChannelServer
from tandem.cluster.rank_spec import RankSpec
from tandem.engine.process_place import this_place
from tandem.engine.rank_loop import RankFailed, RankLoop
from tandem.metrics.http import MetricsServer
from tandem.metrics.labels import RankLabels
from tandem.metrics.rank import RankMetrics
from tandem.wire.channel import Endpoint
from tandem.wire.messages import ProcessPlace, RankId, RankStats, RequestResult
from tandem.wire.prefill_job import PrefillJob, PrefillJobAnswer
from tandem.wire.rank_inbox import (
    Abort,
    CheckIntegrity,
    ConnectPeers,
    JobAnswers,
    PeersLost,
    Reply,
    SetPeers,
    Submit,
    Subscribe,
)


class ModelFilesMissing(FileNotFoundError):
    """The model directory is not readable on the node a rank landed on."""

    @staticmethod
    def at(model_dir: str, place: ProcessPlace) -> ModelFilesMissing:
        return ModelFilesMissing(
            f"model_dir: {model_dir} holds no config.json on node {place.node_id[:12]} "
            f"({place.node_address}); put the model on a path every node can read"
        )


class RankNotReady(RuntimeError):
    def __init__(self, rank: RankId) -> None:
        super().__init__(f"rank {rank} is not set up")


# one thread runs the loop for good; the rest take submits, aborts and calls that wait on the loop
@ray.remote(max_concurrency=16)  # type: ignore[call-overload]
class RankActor:
    def __init__(self, spec: RankSpec) -> None:
        from tandem.cluster import rank_setup  # the rank's process is the one that loads torch
        from tandem.cluster.outbox import ChannelOutbox

        self.spec = spec
        self._setup = rank_setup
        self.device = rank_setup.rank_device()
        self._rendezvous = rank_setup.GroupRendezvous()
        self._channels = ChannelServer(
            ray.util.get_node_ip_address(), self.submit, self.abort, self.subscribe
        )
        self._outbox = ChannelOutbox(self._channels)
        self._stop = threading.Event()
        self._loop_ended = threading.Event()
        self._loop_error: BaseException | None = None
        self._loop: RankLoop | None = None
        self._metrics_server: MetricsServer | None = None
        self._metrics: RankMetrics | None = None

    def place(self) -> ProcessPlace:
        """This rank's node and pid; first checks that the node can read the model."""
        place = this_place()
        if not (Path(self.spec.model_dir) / "config.json").is_file():
            raise ModelFilesMissing.at(self.spec.model_dir, place)
        return place

    def rendezvous_address(self) -> str:
        return self._rendezvous.open(self.spec.collective_timeout_s)

    def setup(self, master: str) -> RankId:
        spec = self.spec
        if spec.cores is not None:  # before the loop, NIXL and torch start their threads
            self._setup.pin_cores(*spec.cores)
        self._loop = loop = self._setup.start_rank(spec, self._rendezvous, self.device, master, self._outbox)
        if spec.metrics is not None:
            labels = RankLabels(
                model=spec.metrics.model,
                role=spec.role.role.value,
                group=spec.rank_id.group_id,
                rank=spec.rank_id.name,
                incarnation=str(spec.incarnation),
            )
            self._metrics = metrics = RankMetrics(labels)
            metrics.watch(loop.stats)
            loop.worker.metrics = metrics
            host = spec.metrics.host or ray.util.get_node_ip_address()
            self._metrics_server = MetricsServer(metrics.registry, host, security=spec.metrics.security)
        return spec.rank_id

    def drain(self) -> None:
        """Take no new requests (a decode rank refuses them with ``RankDraining``); what the
        rank holds runs to its end."""
        self._require().worker.draining = True

    def undrain(self) -> None:
        """Take new requests again: a drain cancelled."""
        self._require().worker.draining = False

    def observe(self, enabled: bool) -> None:
        """Observe the histograms (the default when metrics are served) or not: what
        ``tandem bench metrics`` compares. Scrapes still read the rank's stats."""
        self._require().worker.metrics = self._metrics if enabled else None

    def metrics_address(self) -> str | None:
        """``host:port`` of this rank's ``/metrics`` (``None`` when it serves none)."""
        return self._metrics_server.address if self._metrics_server is not None else None

    def run(self) -> str:
        """The step loop, on this call's thread until the rank stops or fails."""
        try:
            self._require().run(self._stop)
        except BaseException as exc:
            self._loop_error = exc
            raise
        finally:
            self._loop_ended.set()
        return "stopped"

    def watch_loop(self) -> str:
        """Returns (or raises) as ``run`` did, once the loop has ended: a controller that
        restarted watches the ranks it adopted with this, as it cannot see the first
        controller's ``run`` calls."""
        self._loop_ended.wait()
        if self._loop_error is not None:
            raise self._loop_error
        return "stopped"

    def placement_group_id(self) -> str | None:
        """The hex id of the placement group this rank runs in."""
        return ray.get_runtime_context().get_placement_group_id()

    def submit(self, items: list[Any]) -> None:
        """Requests (decode, colocated) or prefill jobs (prefill); ``InvalidRequestError`` for the
        first bad one, taking none of them."""
        loop = self._require()
        loop.post(Submit(loop.worker.admit(items)))

    def submit_jobs(self, jobs: list[PrefillJob], reply_to: Any) -> None:
        """A decode rank's prefill jobs (a prefill rank), each answered to ``reply_to`` (that
        decode rank's actor) as soon as the loop has taken or refused it; a rank not set up, or
        whose loop has failed, refuses them at once."""
        try:
            loop = self._require()
            loop.post(Submit(loop.worker.admit(jobs), functools.partial(_answer, reply_to)))
        except (RankNotReady, RankFailed) as exc:
            name = self.spec.rank_id.name
            _answer(reply_to, [PrefillJobAnswer(job.request_id, name, str(exc)) for job in jobs])

    def prefill_answers(self, answers: list[PrefillJobAnswer]) -> None:
        """Prefill ranks' answers to this decode rank's jobs."""

        with contextlib.suppress(RankFailed):  # a failed rank has ended its requests already
            self._require().post(JobAnswers(tuple(answers)))

    def channel_endpoint(self) -> Endpoint:
        """Where a frontend opens its channel to this rank: host, port and the secret."""
        return self._channels.endpoint()

    def abort(self, request_ids: list[str]) -> None:
        with contextlib.suppress(RankFailed):  # a failed rank has ended its requests already
            self._require().post(Abort(tuple(request_ids)))

    def collect(self, timeout_s: float) -> list[RequestResult]:
        return self._require().collect(timeout_s)

    def stats(self) -> RankStats:
        return self._require().stats()

    def check_integrity(self, timeout_s: float = 30.0) -> None:
        """Page accounting, checked on the loop thread between two iterations; raises
        ``PageAccountingError`` when it does not hold."""
        self._require().ask(CheckIntegrity(Reply()), timeout_s)

    def subscribe(self, subscriber: str) -> Any:
        """Push this rank's KV events to the frontend on its channel from now on (its
        ``Subscribe``, on the channel's thread); the starting snapshot, made on the loop thread
        so that no event falls between it and the next batch."""
        return self._require().ask(Subscribe(subscriber, Reply()), timeout_s=30.0)

    def set_peers(self, peers: dict[RankId, Any]) -> None:
        """The ranks this one sends work to (a decode rank's prefill ranks), with their handles.
        A rank whose loop has failed needs none: its group is about to be rebuilt."""
        with contextlib.suppress(RankFailed):
            self._require().post(SetPeers(peers))

    def connect_peers(self, ranks: list[str]) -> None:
        """Reach the transports of these ranks of the other role now, on the loop thread (the
        membership changed): the first transfer with each pays no wire-up."""
        with contextlib.suppress(RankFailed):
            self._require().post(ConnectPeers(tuple(ranks)))

    def peers_lost(self, ranks: list[str]) -> None:
        """The controller's word that these ranks' processes are gone (see ``RankWorker``)."""
        with contextlib.suppress(RankFailed):
            self._require().post(PeersLost(tuple(ranks)))

    def stop(self) -> None:
        self._stop.set()
        if self._metrics_server is not None:
            self._metrics_server.close()
        self._channels.close()

    def _require(self) -> RankLoop:
        if self._loop is None:
            raise RankNotReady(self.spec.rank_id)
        return self._loop


def _answer(reply_to: Any, answers: list[PrefillJobAnswer]) -> None:
    """Answers back to the decode rank that sent the jobs (a call that is not waited for)."""
    if answers:
        reply_to.prefill_answers.remote(answers)
