"""The one step loop of every rank of a DEP group: prefill, decode and colocated alike.

Threads: ``run`` is the loop and the only thread that touches the worker. Everything a rank
receives from other threads (submits, aborts, prefill jobs and their answers, the peers, the
questions) is a message of ``wire/rank_inbox.py`` on its one inbox (``post``, or ``ask`` to wait
for the answer), taken at the top of an iteration and dispatched by one ``match``
(``_dispatch``). Per iteration every rank:

  1. takes its inbox, then ``worker.tick()`` (polls its transport),
  2. with nothing to compute, waits a little for a call (an idle group does not spin; a rank
     with a KV transfer in flight waits less, as its transport progresses when polled),
  3. joins the one-integer all-reduce that tells whether any rank of the group has work,
  4. if so, steps: its own batch, or an empty one, so that every MoE all-to-all has all ranks,
  5. hands the worker's finished results to ``collect`` and lets it ``publish`` (pushes to
     frontends and subscribers).

When the loop fails (a peer gone mid-collective) every request the worker holds ends with that
error, is published once more, and the error is raised: the rank's ``run`` call ends with it,
which is how its group learns of the failure.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import replace
from typing import Any, Protocol

from tandem.wire.messages import LoopStats, RankStats, RequestResult
from tandem.wire.prefill_job import PrefillJobAnswer
from tandem.wire.rank_inbox import (
    Abort,
    CheckIntegrity,
    ConnectPeers,
    JobAnswers,
    PeersLost,
    RankMessage,
    SetPeers,
    Submit,
    Subscribe,
)


class Observer(Protocol):
    def observe(self, amount: float) -> None: ...


class RankHistograms(Protocol):
    """The histograms a rank's loop and workers observe where their events happen
    (``metrics/rank.py``'s ``RankMetrics`` is the one the rank serves)."""

    @property
    def step_seconds(self) -> Observer: ...

    @property
    def batch_tokens(self) -> Observer: ...

    @property
    def kv_transfer_seconds(self) -> Observer: ...

    @property
    def kv_transfer_exposed_seconds(self) -> Observer: ...

    @property
    def spec_step_tokens(self) -> Observer: ...


class RoleMismatch(RuntimeError):
    """A call the rank's role does not answer (KV events of a decode rank, say)."""


class RankWorker(ABC):
    """A role's work on one rank. ``admit`` runs on the caller's thread; everything else on
    the loop's. The last three are capabilities of some roles only. ``metrics``, when set, takes
    the histograms the worker observes where their events happen."""

    name: str
    metrics: RankHistograms | None = None
    draining: bool = False  # set by the controller: the rank's group is being removed

    @abstractmethod
    def admit(self, items: list[Any]) -> Any:
        """Check submitted items without touching the loop's state (``InvalidRequestError`` for
        the first bad one); what ``submit`` takes."""

    @abstractmethod
    def submit(self, admitted: Any) -> list[Any] | None:
        """Take what ``admit`` checked; a role that answers its senders (a prefill rank's
        ``PrefillJobAnswer``s) returns the answers."""

    @abstractmethod
    def abort(self, request_id: str) -> None: ...

    @abstractmethod
    def tick(self) -> None:
        """Every iteration, stepping or not: poll the transport, expire deadlines."""

    @abstractmethod
    def has_work(self) -> bool:
        """Something to compute this step (not merely waiting on a transfer)."""

    @abstractmethod
    def step(self) -> None:
        """One step of the group; may be an empty batch (the MoE layers serve the peers)."""

    @abstractmethod
    def take_results(self) -> list[RequestResult]:
        """Results to report through ``collect`` since the last call."""

    @abstractmethod
    def fail_all(self, reason: str) -> list[RequestResult]:
        """End everything the worker holds with ``reason``; the results to report."""

    @abstractmethod
    def stats(self, loop: LoopStats) -> RankStats: ...

    @abstractmethod
    def check_integrity(self) -> None:
        """Raise ``PageAccountingError`` unless the rank's pages and requests agree."""

    def close(self) -> None:  # noqa: B027  (a role with nothing to release keeps this)
        """The loop has ended (stopped or failed): release what the worker holds outside the
        process's memory (its store client, its tiers' threads). Bounded: it must not hang."""

    def transfers_in_flight(self) -> bool:
        """KV transfers this rank sends or awaits: the loop then polls its transport often (a
        transfer progresses, and is noticed complete, only when the transport is polled)."""
        return False

    def publish(self) -> None:  # noqa: B027  (a role with nothing to push keeps this)
        """End of an iteration: push streams and events to the actors that asked for them."""

    def subscribe(self, subscriber: str) -> Any:
        raise RoleMismatch(f"rank {self.name} publishes no events")

    def unsubscribe(self, subscriber: str) -> None:
        raise RoleMismatch(f"rank {self.name} publishes no events")

    def set_peers(self, peers: dict[Any, Any]) -> None:
        raise RoleMismatch(f"rank {self.name} sends work to no other rank")

    def connect_peers(self, ranks: list[str]) -> None:  # noqa: B027  (a rank without a transport)
        """Reach these ranks' transports now, ahead of the first transfer with each."""

    def peers_lost(self, ranks: list[str]) -> None:  # noqa: B027  (a rank without a transport)
        """These ranks' incarnations are dead (their processes are gone): fail every transfer
        with them at once instead of waiting for its deadline."""

    def prefill_answered(self, answer: PrefillJobAnswer) -> None:
        raise RoleMismatch(f"rank {self.name} sends no prefill jobs")


class RankDraining(RuntimeError):
    """The rank is being drained: it finishes what it holds and takes nothing new (the caller
    routes the request elsewhere)."""

    def __init__(self, rank: str) -> None:
        super().__init__(f"rank {rank} is draining and takes no new requests")
        self.rank = rank

    def __reduce__(self) -> tuple[type, tuple[str]]:
        return (RankDraining, (self.rank,))


class RankFailed(RuntimeError):
    def __init__(self, rank: str, reason: str) -> None:
        super().__init__(f"rank {rank} has failed: {reason}")
        self.rank, self.reason = rank, reason


class RankLoop:
    def __init__(
        self,
        worker: RankWorker,
        name: str,
        agree: Callable[[bool], bool],
        idle_wait_s: float = 0.005,
        transfer_poll_s: float = 0.0005,
    ) -> None:
        """``agree(has_work)`` is the group's all-reduce: whether any rank has work. With nothing
        to compute the loop waits ``idle_wait_s`` for a call, ``transfer_poll_s`` while a KV
        transfer is in flight."""
        self.worker = worker
        self.name = name
        self._agree = agree
        self.idle_wait_s = idle_wait_s
        self.transfer_poll_s = min(transfer_poll_s, idle_wait_s)
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._results_ready = threading.Condition(self._lock)
        self._inbox: list[RankMessage] = []
        self._results: list[RequestResult] = []
        self._steps = self._idle_waits = 0
        self._agree_s = self._step_s = self._idle_s = self._tick_s = self._publish_s = 0.0
        self.failure: str | None = None

    def post(self, message: RankMessage) -> None:
        """Put ``message`` on the rank's inbox (its payload checked before); ``RankFailed`` once
        the loop has failed."""
        with self._lock:
            if self.failure is not None:
                raise RankFailed(self.name, self.failure)
            self._inbox.append(message)
        self._ready.set()

    def ask(self, message: CheckIntegrity | Subscribe, timeout_s: float) -> Any:
        """Post a question and wait for its answer (or raise the exception it gave);
        ``TimeoutError`` when the loop does not get to it within ``timeout_s``."""
        self.post(message)
        return message.reply.wait(timeout_s, self.name)

    def collect(self, timeout_s: float) -> list[RequestResult]:
        """Results since the last call; waits up to ``timeout_s`` for at least one."""
        with self._results_ready:
            if not self._results:
                self._results_ready.wait(timeout_s)
            out, self._results = self._results, []
            return out

    def stats(self) -> RankStats:
        """Read off the loop thread, without stopping it: counts may be an iteration old."""
        loop = LoopStats(self._steps, self._idle_waits, self._agree_s, self._step_s)
        loop = replace(loop, idle_s=self._idle_s, tick_s=self._tick_s, publish_s=self._publish_s)
        return self.worker.stats(loop)

    def run(self, stop: threading.Event) -> None:
        worker = self.worker
        try:
            while not stop.is_set():
                t0 = time.perf_counter()
                self._run_calls()
                worker.tick()
                has_work = worker.has_work()
                t1 = time.perf_counter()
                self._tick_s += t1 - t0
                if not has_work:
                    self._idle_waits += 1
                    wait_s = self.transfer_poll_s if worker.transfers_in_flight() else self.idle_wait_s
                    woken = self._ready.wait(wait_s)
                    t2 = time.perf_counter()
                    self._idle_s += t2 - t1
                    if woken:
                        self._run_calls()
                        has_work = worker.has_work()
                    t1 = time.perf_counter()
                    self._tick_s += t1 - t2
                anyone = self._agree(has_work)
                t2 = time.perf_counter()
                self._agree_s += t2 - t1
                if anyone:
                    worker.step()
                    self._steps += 1
                    t3 = time.perf_counter()
                    self._step_s += t3 - t2
                    if worker.metrics is not None:
                        worker.metrics.step_seconds.observe(t3 - t2)
                    t2 = t3
                self._publish(worker.take_results())
                worker.publish()
                self._publish_s += time.perf_counter() - t2
        except Exception as exc:
            reason = f"rank {self.name} failed: {type(exc).__name__}: {exc}"
            with self._lock:
                self.failure = reason
            self._publish(worker.fail_all(reason))
            worker.publish()
            raise
        finally:
            worker.close()

    def _run_calls(self) -> None:
        with self._lock:
            messages, self._inbox = self._inbox, []
            self._ready.clear()
        for message in messages:
            self._dispatch(message)

    def _dispatch(self, message: RankMessage) -> None:
        """One message of the inbox, on the loop thread."""
        worker = self.worker
        match message:
            case Submit(admitted, answer):
                answers = worker.submit(admitted)
                if answer is not None and answers:
                    answer(answers)
            case Abort(request_ids):
                for request_id in request_ids:
                    worker.abort(request_id)
            case JobAnswers(answers):
                for job_answer in answers:
                    worker.prefill_answered(job_answer)
            case SetPeers(peers):
                worker.set_peers(peers)
            case ConnectPeers(ranks):
                worker.connect_peers(list(ranks))
            case PeersLost(ranks):
                worker.peers_lost(list(ranks))
            case CheckIntegrity(reply):
                reply.give(worker.check_integrity)
            case Subscribe(subscriber, reply):
                reply.give(lambda: worker.subscribe(subscriber))

    def _publish(self, results: list[RequestResult]) -> None:
        if results:
            with self._results_ready:
                self._results.extend(results)
                self._results_ready.notify_all()
