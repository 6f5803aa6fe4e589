"""One rank of a DEP group: its own scheduler and KV pool, its slice of the experts, and the step
loop that keeps it in lockstep with the other ranks.

Threads: ``run`` is the step loop and the only thread that touches the scheduler and the model;
``submit``, ``abort`` and ``collect`` are called from other threads and talk to it through the
inbox and the outbox, both under ``_lock``.

Per loop iteration every rank:
  1. takes newly submitted requests and aborts from its inbox,
  2. with nothing to do, waits a little for the inbox (an idle group does not spin),
  3. joins the one-integer all-reduce that tells whether any rank has work,
  4. if so, steps: its own batch, or an empty one, so that every MoE all-to-all has all ranks.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

from tandem.engine.colocated import ColocatedEngine
from tandem.engine.dep import ExpertParallelDispatcher, any_rank_has_work
from tandem.engine.request import Request, SamplingParams


@dataclass(frozen=True)
class RankRequest:
    """A request addressed to a rank. ``prefill_rank`` is the router's choice of prefill rank
    (disaggregated decode ranks only); with ``frontend`` set, the decode rank streams the tokens
    and the result to that named frontend actor instead of reporting them through ``collect``."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    prefill_rank: str | None = None
    frontend: str | None = None


@dataclass(frozen=True)
class FinishedRequest:
    """A request's result; ``finish_reason`` is ``stop``, ``length``, ``abort`` or ``error``."""

    request_id: str
    token_ids: list[int]
    prompt_tokens: int
    cached_tokens: int
    finish_reason: str
    error: str | None = None


@dataclass
class RankStats:
    rank: int
    local_experts: int = 0
    steps: int = 0
    idle_waits: int = 0
    step_s: float = 0.0
    forward_s: float = 0.0
    all_to_all_s: float = 0.0
    agree_s: float = 0.0
    moe_rows_sent: int = 0
    moe_rows_received: int = 0
    running: int = 0
    waiting: int = 0
    free_pages: int = 0


@dataclass
class _Mailbox:
    requests: list[RankRequest] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    finished: list[FinishedRequest] = field(default_factory=list)


class DEPRankLoop:
    def __init__(
        self,
        engine: ColocatedEngine,
        rank: int,
        dispatcher: ExpertParallelDispatcher,
        idle_wait_s: float = 0.02,
    ) -> None:
        self.engine = engine
        self.rank = rank
        self.dispatcher = dispatcher
        self.idle_wait_s = idle_wait_s
        self._lock = threading.Lock()
        self._inbox_ready = threading.Event()
        self._finished_ready = threading.Condition(self._lock)
        self._mail = _Mailbox()
        self._stats = RankStats(rank, local_experts=len(dispatcher.local))
        self.failure: str | None = None

    # -- called from other threads -------------------------------------------------------------
    def submit(self, requests: list[RankRequest]) -> None:
        """Validate every request (raising ``InvalidRequestError`` for the first bad one, taking
        none of them) and queue them for the step loop."""
        for r in requests:
            r.sampling.validate()
            self.engine.validate_prompt(r.prompt_token_ids)
        with self._lock:
            if self.failure is not None:
                raise RuntimeError(f"rank {self.rank} has failed: {self.failure}")
            self._mail.requests.extend(requests)
        self._inbox_ready.set()

    def abort(self, request_ids: list[str]) -> None:
        with self._lock:
            self._mail.aborts.extend(request_ids)
        self._inbox_ready.set()

    def collect(self, timeout_s: float) -> list[FinishedRequest]:
        """Finished requests since the last call; waits up to ``timeout_s`` for at least one."""
        with self._finished_ready:
            if not self._mail.finished:
                self._finished_ready.wait(timeout_s)
            out, self._mail.finished = self._mail.finished, []
            return out

    def stats(self) -> RankStats:
        scheduler = self.engine.scheduler
        s = self._stats
        s.all_to_all_s = self.dispatcher.stats.all_to_all_s
        s.moe_rows_sent = self.dispatcher.stats.rows_sent
        s.moe_rows_received = self.dispatcher.stats.rows_received
        s.forward_s = self.engine.runner.stats.forward_s
        s.running, s.waiting = scheduler.num_running, scheduler.num_waiting
        s.free_pages = scheduler.kv_cache.num_free_pages
        return RankStats(**vars(s))

    # -- the step loop -------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Step until ``stop`` is set. On an error (a peer gone mid-collective) every request this
        rank holds ends with that error, and the error is raised."""
        try:
            while not stop.is_set():
                self._take_mail()
                has_work = self.engine.scheduler.has_unfinished_requests()
                if not has_work:
                    self._stats.idle_waits += 1
                    if self._inbox_ready.wait(self.idle_wait_s):
                        self._take_mail()
                        has_work = self.engine.scheduler.has_unfinished_requests()
                t0 = time.perf_counter()
                anyone = any_rank_has_work(has_work, self.dispatcher.group, self.engine.model.device)
                t1 = time.perf_counter()
                self._stats.agree_s += t1 - t0
                if anyone:
                    self._finish(self.engine.step())
                    self._stats.steps += 1
                    self._stats.step_s += time.perf_counter() - t1
        except Exception as exc:
            self._fail_all(f"rank {self.rank} failed: {type(exc).__name__}: {exc}")
            raise

    def _take_mail(self) -> None:
        with self._lock:
            requests, self._mail.requests = self._mail.requests, []
            aborts, self._mail.aborts = self._mail.aborts, []
            self._inbox_ready.clear()
        for r in requests:
            self.engine.add_request(r.prompt_token_ids, r.sampling, r.request_id)
        aborted = []
        for request_id in aborts:
            request = self.engine.scheduler.get_request(request_id)
            if request is not None and self.engine.abort(request_id):
                aborted.append(request)
        self._finish(aborted)

    def _finish(self, requests: list[Request]) -> None:
        if not requests:
            return
        done = [
            FinishedRequest(
                r.request_id,
                list(r.output_token_ids),
                r.num_prompt_tokens,
                r.num_cached_tokens,
                r.finish_reason or "abort",
            )
            for r in requests
        ]
        with self._finished_ready:
            self._mail.finished.extend(done)
            self._finished_ready.notify_all()

    def _fail_all(self, reason: str) -> None:
        scheduler = self.engine.scheduler
        with self._finished_ready:
            self.failure = reason
            pending = [r.request_id for r in self._mail.requests]
            self._mail.requests = []
        held = scheduler.unfinished_requests()
        for r in held:  # the loop thread calls this: the scheduler is ours to change
            scheduler.abort_request(r.request_id)
        failed = [FinishedRequest(r.request_id, list(r.output_token_ids), r.num_prompt_tokens,
                                  r.num_cached_tokens, "error", reason) for r in held]  # fmt: skip
        failed += [FinishedRequest(i, [], 0, 0, "error", reason) for i in pending]
        with self._finished_ready:
            self._mail.finished.extend(failed)
            self._finished_ready.notify_all()
