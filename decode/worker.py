"""A decode rank's work, without the threads and collectives around it.

The decode rank owns a request from routing to its end::

    submit -> queue -> reserve pages -> PrefillJob to a prefill rank (expect its KV)
           -> KV arrives (first token) -> running batch, one token a step -> finished + bill
    a failed or late transfer: abort it, then retry on another prefill rank or end with an error

A request submitted with a :class:`Routing` goes first to the prefill rank its router chose, and
its tokens are streamed: every new token (with its wall-clock time) and finally its result are
gathered per frontend and pushed in :meth:`publish`, one batch per frontend per loop iteration.
Requests without a frontend report through :meth:`take_results`.

``tick`` takes the KV that arrived, the transfers that failed, the reservations past their
deadline, then sends prefill jobs for new reservations, and holds out of the next step the
running guided requests whose grammar still compiles; ``step`` runs one decode batch.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.types import AbortAction, DecodeFinished, KVNotificationError, Reservation
from tandem.engine.admission import request_of
from tandem.engine.bill_builder import build_bill, delivered_cached_by_tier, delivered_prompt_tokens
from tandem.engine.drafter import Drafter
from tandem.engine.prefix_cache import prompt_chain
from tandem.engine.rank_loop import RankDraining
from tandem.engine.request import Request, RequestStatus
from tandem.engine.runner import ModelRunner
from tandem.engine.speculation import SpeculativeConfig
from tandem.engine.stream_publisher import StreamPublisher
from tandem.engine.transfer_worker import TransferWorker
from tandem.kvtransfer.transport import KVTransport, ReceivedKV, TransferFailure
from tandem.kvtransfer.types import FailureCounts, KVTransferAborted, KVTransferError
from tandem.wire.logprobs import TokenLogprobs, parse_all
from tandem.wire.messages import (
    Bill,
    CachedByTier,
    LoopStats,
    PrefillAttempt,
    RankId,
    RankRequest,
    RankStats,
    RequestResult,
    Role,
    Speculation,
    StreamBatch,
    TierStats,
    TransferId,
)
from tandem.wire.prefill_job import PrefillJob, PrefillJobAnswer
from tandem.wire.request_params import FinishReason, InvalidRequestError

if TYPE_CHECKING:
    from tandem.engine.outbox import Outbox
    from tandem.engine.tier_copier import TierCopier
    from tandem.model.config import ModelConfig

log = logging.getLogger(__name__)


class PrefillDispatcher(ABC):
    """Chooses a prefill rank for a job and sends it there."""

    @abstractmethod
    def choose(self, request: Request, preferred: RankId | None = None) -> RankId:
        """The prefill rank to compute ``request``'s KV: ``preferred`` (the router's choice)
        when this rank knows it, else one of its own choosing."""

    @abstractmethod
    def send(self, prefill_rank: RankId, job: PrefillJob) -> None: ...

    @abstractmethod
    def set_ranks(self, ranks: dict[RankId, Any]) -> None:
        """The prefill ranks that take jobs now, with their handles."""


@dataclass(frozen=True)
class Routing:
    """Where a request came from and the prefill rank its router chose."""

    prefill_rank: RankId | None = None
    frontend: str | None = None
    fork_of: str | None = None  # the request whose prompt KV it may share (``RankRequest.fork_of``)


@dataclass
class _Track:
    """The decode worker's record of one request it holds: routing, its current transfer, and
    the readings of this rank's monotonic clock its bill is made of. Where the request is, the
    scheduler says; the track only times it: queued since ``queued_at``, waiting for KV since
    ``expect_at``, running since ``running_at``."""

    arrival: float  # received by the rank's actor
    routing: Routing = field(default_factory=Routing)
    transfer: TransferId | None = None
    prefill_rank: RankId | None = None
    job_tokens: int = 0  # tokens the current attempt's prefill job carries
    queued_at: float | None = None
    expect_at: float = 0.0
    running_at: float | None = None
    streamed: int = 0  # output tokens already pushed to the frontend
    pickup_s: float = 0.0
    reservation_wait_s: float = 0.0
    decode_s: float = 0.0
    preemptions: int = 0
    attempts: list[PrefillAttempt] = field(default_factory=list)
    token_at: list[float] = field(default_factory=list)  # when each output token was known
    speculation: Speculation = field(default_factory=Speculation)
    guide_error: str | None = None  # its grammar did not compile here: it ends once running

    def stop_running(self, now: float) -> None:
        if self.running_at is not None:
            self.decode_s += now - self.running_at
            self.running_at = None

    def bill(self, request: Request | None, now: float) -> Bill:
        self.stop_running(now)
        cached, new = delivered_prompt_tokens(self.attempts)
        return build_bill(
            cached_by_tier=delivered_cached_by_tier(self.attempts),
            prompt_tokens=request.num_prompt_tokens if request else 0,
            cached_tokens=cached,
            new_prompt_tokens=new,
            output_tokens=len(request.output_token_ids) if request else 0,
            preemptions=self.preemptions,
            attempts=self.attempts,
            arrival=self.arrival,
            token_at=self.token_at,
            now=now,
            pickup_s=self.pickup_s,
            decode_s=self.decode_s,
            reservation_wait_s=self.reservation_wait_s,
            speculation=self.speculation,
        )


class DecodeWorker(TransferWorker):
    def __init__(
        self,
        rank_id: RankId,
        incarnation: int,
        scheduler: DecodeScheduler,
        runner: ModelRunner,
        transport: KVTransport,
        dispatcher: PrefillDispatcher,
        kv_timeout_s: float = 30.0,
        model_config: ModelConfig | None = None,
        outbox: Outbox | None = None,
        speculative: SpeculativeConfig | None = None,
        drafter: Drafter | None = None,
        writeback: TierCopier | None = None,
    ) -> None:
        """``speculative`` with ``num_tokens`` > 0: each step verifies ``drafter``'s drafts.
        ``writeback``: the shared store's writer over this rank's pool; finished requests' pages
        go there."""
        self.rank_id, self.incarnation, self.name = rank_id, incarnation, rank_id.name
        self.speculative = speculative or SpeculativeConfig()
        if self.speculative.enabled and drafter is None:
            raise ValueError(f"decode rank {rank_id.name}: speculative decoding needs a drafter")
        self.drafter = drafter
        self.writeback = writeback
        self.speculation = Speculation()
        self.scheduler = scheduler
        self.runner = runner
        self.transport = transport
        self.dispatcher = dispatcher
        self.kv_timeout_s = kv_timeout_s
        self.model_config = model_config
        self.outbox = outbox
        self._tracks: dict[str, _Track] = {}
        self._transfers: dict[str, TransferId] = {}  # transport key -> the transfer it names
        self.streams = StreamPublisher(rank_id)
        self.kv_bytes_received = 0
        self.preemptions = 0
        self.forks = 0  # requests started on another's prompt KV (``_fork``)
        self.failure_counts = FailureCounts()
        self._schedule_s = self._update_s = self._draft_s = 0.0
        self._guided: set[str] = set()  # requests whose grammar is not known to be ready yet
        self._held: frozenset[str] = frozenset()  # running ones it keeps out of the next step

    # -- requests in (admit on the caller's thread, the rest on the loop's) ----------------------
    def admit(self, items: list[RankRequest]) -> list[tuple[Request, Routing, float]]:
        """Requests built and checked against this rank's limits: one that could never run
        fails here, alone, instead of on the loop."""
        cfg = self.model_config
        if cfg is None:
            raise RuntimeError(f"decode rank {self.name} was built without a model config")
        if self.draining:
            raise RankDraining(self.name)
        config = self.scheduler.config
        eos = frozenset(cfg.eos_token_ids)
        received = time.monotonic()
        admitted = []
        for r in items:
            limit = cfg.max_position_embeddings
            request = request_of(r, cfg.vocab_size, eos, limit, config.page_size, config.num_pages)
            fork_of = r.fork_of if not r.resume_output_ids else None
            admitted.append((request, Routing(r.prefill_rank, r.frontend, fork_of), received))
        return admitted

    def submit(self, admitted: list[tuple[Request, Routing, float]]) -> None:
        now = time.monotonic()
        for request, routing, received in admitted:
            track = _Track(received, routing, queued_at=now, pickup_s=now - received)
            # resumed: its client has these outputs already (known here from the moment it came)
            track.streamed = len(request.output_token_ids)
            track.token_at = [received] * track.streamed
            try:
                forked = routing.fork_of is not None and self._fork(request, routing.fork_of, track, now)
                if not forked:
                    self.scheduler.add_request(request)
            except InvalidRequestError as error:  # e.g. its id is in use here: it alone fails
                self._report(
                    track, self._result(request.request_id, None, track, FinishReason.ERROR, str(error))
                )
                continue
            self._tracks[request.request_id] = track
            self.runner.prepare_guide(request.sampling)  # compiled while its KV is computed
            if request.sampling.guide is not None:
                self._guided.add(request.request_id)

    def _fork(self, request: Request, parent_id: str, track: _Track, now: float) -> bool:
        """Start ``request`` on the prompt KV of ``parent_id`` (``DecodeScheduler.fork``): its
        pages copied before the next step, its bill one attempt with every prompt token but the
        last cached on this rank's device and no transfer. Not with a drafter (an MTP draft
        needs the prompt's last hidden state, which only a prefill gives) nor for prompt
        logprobs (a prefill computes them)."""
        if self.drafter is not None or request.sampling.prompt_logprobs is not None:
            return False
        copies = self.scheduler.fork(request, parent_id)
        if copies is None:
            return False
        self.runner.pool.copy_pages(copies)
        shared = request.num_prompt_tokens - 1
        request.num_cached_tokens = shared
        track.attempts.append(
            PrefillAttempt(
                attempt=0,
                delivered=True,
                prompt_tokens=request.num_prompt_tokens,
                cached_tokens=shared,
                cached_by_tier=CachedByTier(device=shared),
            )
        )
        track.running_at = now
        self.forks += 1
        return True

    def abort(self, request_id: str) -> None:
        result = self.scheduler.abort(request_id)
        track = self._tracks.get(request_id)
        if result.action is AbortAction.CANCEL_TRANSFER and track is not None and track.transfer is not None:
            self.transport.abort_receive(track.transfer.key)
        elif result.finished is not None:
            self._finish(result.finished)

    def abort_frontend(self, frontend: str) -> int:
        """Abort every request of a frontend that is gone; how many."""
        ids = [rid for rid, track in self._tracks.items() if track.routing.frontend == frontend]
        for request_id in ids:
            self.abort(request_id)
        return len(ids)

    def set_peers(self, peers: dict[RankId, Any]) -> None:
        self.dispatcher.set_ranks(peers)

    def peers_lost(self, ranks: list[str]) -> None:
        """Prefill ranks whose group failed: their receives fail now and are retried on the
        prefill ranks of the membership (which no longer lists them)."""
        for rank in ranks:
            self.transport.fence_peer(rank)

    # -- the loop ---------------------------------------------------------------------------------
    def has_work(self) -> bool:
        """A batch to decode this step; requests only waiting for their KV, or for their
        grammar, need no step."""
        return self.scheduler.num_running > len(self._held)

    def tick(self) -> None:
        now = time.monotonic()
        events = self.transport.poll()
        for got in events.received:
            self._kv_arrived(got)
        for failure in events.failed:
            self._kv_failed(failure)
        self._abort_expired(now)
        for reservation in self.scheduler.reserve(now):
            self._send_prefill_job(reservation)
        self._held = self._grammars_held()

    def _grammars_held(self) -> frozenset[str]:
        """Running guided requests whose grammar still compiles: they sit the next step out (a
        step never waits for a compile, nor does the DEP group) and join once it is ready. One
        whose grammar did not compile, or not within the limit, ends with the error once its
        KV is here, its pages freed."""
        held = set()
        for request_id in list(self._guided):
            request, track = self.scheduler.get(request_id), self._tracks.get(request_id)
            if request is None or track is None:
                self._guided.discard(request_id)
                continue
            if track.guide_error is None:
                try:
                    if self.runner.guide_ready(request_id, request.sampling, track.arrival):
                        self._guided.discard(request_id)
                        continue
                except InvalidRequestError as error:
                    track.guide_error = str(error)
            if request.status is not RequestStatus.RUNNING:
                continue
            if track.guide_error is None:
                held.add(request_id)
            elif (finished := self.scheduler.fail(request_id, track.guide_error)) is not None:
                self._finish(finished)
        return frozenset(held)

    def step(self) -> None:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(self._draft_room(), self._held)
        self._schedule_s += time.perf_counter() - t0
        preempted_at = time.monotonic()
        for request_id in plan.preempted_request_ids:  # back in the queue, to be recomputed
            self.preemptions += 1
            if self.drafter is not None:
                self.drafter.forget(request_id)
            track = self._tracks.get(request_id)
            if track is not None:
                track.stop_running(preempted_at)
                track.queued_at, track.preemptions = preempted_at, track.preemptions + 1
        if self.drafter is not None:  # every step, a chunk or not: an MTP drafter steps with its group
            t_draft = time.perf_counter()
            running = [r for c in plan.chunks if (r := self.scheduler.get(c.request_id)) is not None]
            drafts = self.drafter.propose(running, {c.request_id: c.draft_room for c in plan.chunks})
            plan = self.scheduler.with_drafts(plan, drafts)
            self._draft_s += time.perf_counter() - t_draft
        if self.metrics is not None:
            self.metrics.batch_tokens.observe(plan.num_batched_tokens)
        sampled = self.runner.verify(plan) if self.speculative.enabled else self.runner.run(plan)
        t1 = time.perf_counter()
        now, now_unix_s = time.monotonic(), time.time()
        chunks = [(c, r) for c in plan.chunks if (r := self.scheduler.get(c.request_id)) is not None]
        before = [len(r.output_token_ids) for _, r in chunks]
        finished = self.scheduler.update(plan, sampled)
        for (chunk, request), count in zip(chunks, before, strict=True):
            given = len(request.output_token_ids) - count
            track = self._tracks.get(request.request_id)
            if track is None or given <= 0:
                continue
            track.token_at.extend([now] * given)  # a verify step's tokens are known together
            if request.sampling.logprobs is not None:
                request.record_output_logprobs(given, self.runner.logprobs.get(request.request_id, []))
            self._count_speculation(track, chunk.draft_token_ids, given)
            if self.drafter is not None and not request.is_finished:
                needs = self.drafter.needs_hidden
                hidden = self.runner.hidden_rows(request.request_id, given) if needs else None
                self.drafter.observe(request.request_id, request.output_token_ids[-given:], hidden)
            self._stream_new_tokens(request, track, now_unix_s)
        for record in finished:
            self._finish(record)
        self._update_s += time.perf_counter() - t1

    def _draft_room(self) -> dict[str, int]:
        """The drafts each running request may have this step (none without speculation, and
        none for a structured output: its drafts are not checked against its grammar)."""
        if self.drafter is None:
            return {}
        k = self.speculative.num_tokens
        return {r.request_id: 0 if r.sampling.guide else k for r in self.scheduler.running_requests()}

    def _count_speculation(self, track: _Track, drafts: tuple[int, ...], given: int) -> None:
        """A decode step's drafts and tokens, in the request's bill and the rank's totals (steps
        are counted with speculation off too: its acceptance length is 1.0)."""
        accepted = min(given - 1, len(drafts))
        track.speculation = track.speculation.plus(len(drafts), accepted)
        self.speculation = self.speculation.plus(len(drafts), accepted)
        if self.metrics is not None and self.speculative.enabled:
            self.metrics.spec_step_tokens.observe(given)

    def take_results(self) -> list[RequestResult]:
        return self.streams.take_results()

    def take_pushes(self) -> dict[str, StreamBatch]:
        """Token deltas and results of streamed requests since the last call, by frontend."""
        return self.streams.take_pushes()

    def publish(self) -> None:
        """Push each frontend its batch; a frontend that is gone loses its requests (aborted)."""
        if self.outbox is None:
            return
        for frontend in self.streams.publish(self.outbox):
            self.abort_frontend(frontend)

    def fail_all(self, reason: str) -> list[RequestResult]:
        """End every request this rank holds with ``reason`` (its group is going down), each
        result marked as the rank's failure, not the request's, so its frontend moves it."""
        for request_id, track in list(self._tracks.items()):
            request = self.scheduler.get(request_id)
            result = self._result(request_id, request, track, FinishReason.ERROR, reason)
            self._report(track, dataclasses.replace(result, rank_failure=reason))
            if self.drafter is not None:
                self.drafter.forget(request_id)
        self._tracks.clear()
        self._guided.clear()
        return self.take_results()

    def stats(self, loop: LoopStats) -> RankStats:
        d = self.scheduler
        sends, receives = self.transport.in_flight()
        return RankStats(
            rank=self.rank_id,
            role=Role.DECODE,
            incarnation=self.incarnation,
            loop=loop,
            queued=d.num_queued,
            running=d.num_running,
            waiting_for_kv=d.num_waiting_for_kv,
            free_pages=d.num_free_pages,
            total_pages=d.config.num_pages,
            kv_bytes_received=self.kv_bytes_received,
            sends_in_flight=sends,
            peers_connected=self.transport.connected_peers(),
            receives_in_flight=receives,
            preemptions=self.preemptions,
            speculation=self.speculation,
            transfer_failures=self.failure_counts.as_tuple(),
            weight_bytes=self.runner.weight_bytes,
            forward_s=self.runner.stats.forward_s,
            split=self.runner.split(self._schedule_s, self._update_s, self._draft_s),
            tiers=self.writeback.tiers.stats() if self.writeback is not None else TierStats(),
        )

    def close(self) -> None:
        if self.writeback is not None:
            self.writeback.tiers.close()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()

    # -- tick's steps -----------------------------------------------------------------------------
    def _kv_arrived(self, got: ReceivedKV) -> None:
        transfer = self._transfers.pop(got.notification.request_id, None)
        if transfer is None:  # a transfer this rank no longer waits for
            return
        n = got.notification
        try:
            first_logprobs, prompt_logprobs = _notified_logprobs(transfer.request_id, n.logprobs)
            finished = self.scheduler.kv_arrived(
                transfer.request_id,
                n.first_token,
                n.cached_tokens,
                attempt=transfer.attempt,
                logprobs=first_logprobs,
                prompt_logprobs=prompt_logprobs,
            )
        except KVNotificationError as error:  # its writes are over: this attempt fails, not the rank
            self._transfers[n.request_id] = transfer
            self._kv_failed(TransferFailure(n.request_id, "recv", KVTransferError(n.request_id, str(error))))
            return
        self.kv_bytes_received += n.kv_bytes
        usable = time.monotonic()  # the KV is the request's: it decodes from the next step
        track = self._tracks.get(transfer.request_id)
        if track is not None:
            seen = got.stats.end_s  # when this rank's poll got the notification
            timings = n.timings
            attempt = PrefillAttempt(
                attempt=transfer.attempt,
                prefill_rank=track.prefill_rank,
                delivered=True,
                prompt_tokens=track.job_tokens,
                cached_tokens=n.cached_tokens,
                cached_by_tier=CachedByTier(
                    n.cached_device_tokens, n.cached_host_tokens, n.cached_store_tokens
                ),
                kv_bytes=n.kv_bytes,
                kv_wait_s=seen - track.expect_at,
                kv_accept_s=usable - seen,
                prefill_pickup_s=timings.prefill_pickup_s,
                prefill_queue_s=timings.prefill_queue_s,
                prefill_compute_s=timings.prefill_compute_s,
                kv_transfer_s=timings.kv_transfer_s,
                kv_sender_exposed_s=timings.kv_sender_exposed_s,
            )
            track.attempts.append(attempt)
            track.running_at = usable
            if self.metrics is not None:
                self.metrics.kv_transfer_exposed_seconds.observe(attempt.kv_transfer_exposed_s)
            if not track.token_at:
                track.token_at.append(usable)
        request = self.scheduler.get(transfer.request_id)
        if self.drafter is not None and request is not None and not request.is_finished:
            self.drafter.start(transfer.request_id, n.draft_state)
        if track is not None and request is not None:
            self._stream_new_tokens(request, track, time.time())
        if finished is not None:
            self._finish(finished)

    def _kv_failed(self, failure: TransferFailure) -> None:
        if failure.role != "recv":
            return
        self.failure_counts.add("recv", failure.error)
        transfer = self._transfers.pop(failure.request_id, None)
        if transfer is None:
            return
        now = time.monotonic()
        track = self._tracks.get(transfer.request_id)
        if track is not None:
            track.attempts.append(
                PrefillAttempt(
                    attempt=transfer.attempt,
                    prefill_rank=track.prefill_rank,
                    error=str(failure.error),
                    kv_wait_s=now - track.expect_at,
                )
            )
            track.queued_at = now  # a retry waits for its next reservation from here
        retry = not isinstance(failure.error, KVTransferAborted) or "prefill" in failure.error.by
        finished = self.scheduler.kv_failed(
            transfer.request_id, str(failure.error), retry, attempt=transfer.attempt
        )
        if finished is not None:
            self._finish(finished)

    def _abort_expired(self, now: float) -> None:
        for request_id in self.scheduler.expired(now):
            transfer = self._tracks[request_id].transfer
            if transfer is not None:
                self.transport.abort_receive(transfer.key)

    def _send_prefill_job(self, reservation: Reservation) -> None:
        request = self.scheduler.get(reservation.request_id)
        assert request is not None
        transfer = TransferId(request.request_id, reservation.attempt)
        track = self._tracks[request.request_id]
        # the router's choice holds for the first attempt; a retry goes where this rank likes
        preferred = track.routing.prefill_rank if reservation.attempt <= 1 else None
        prefill_rank = self.dispatcher.choose(request, preferred)
        now = time.monotonic()
        if track.queued_at is not None:
            track.reservation_wait_s += now - track.queued_at
            track.queued_at = None
        track.transfer, track.prefill_rank, track.expect_at = transfer, prefill_rank, now
        track.job_tokens = reservation.num_prompt_tokens
        self._transfers[transfer.key] = transfer
        self.transport.expect(transfer.key, prefill_rank.name, reservation.page_ids, self.kv_timeout_s)
        job = PrefillJob(
            request_id=transfer.key,
            prompt_token_ids=tuple(request.all_token_ids[: reservation.num_prompt_tokens]),
            sampling=request.sampling,
            output_index=len(request.output_token_ids),
            destination=reservation.destination(self.name, self.incarnation),
            deadline_s=time.time() + self.kv_timeout_s,
            cache_salt=request.cache_salt,
        )
        self.dispatcher.send(prefill_rank, job)

    # -- a prefill rank's answer to a job --------------------------------------------------------
    def prefill_answered(self, answer: PrefillJobAnswer) -> None:
        """A refused job's attempt ends now, as a failed prefill's does (its reservation freed,
        the request retried or ended with the refusal), not at its KV deadline. Its receive is
        given up too: the transport's report of that (an abort) comes for a transfer no longer
        waited for."""
        if answer.accepted or answer.request_id not in self._transfers:
            return
        self.transport.abort_receive(answer.request_id)
        refusal = f"prefill rank {answer.prefill_rank} refused the job: {answer.refusal}"
        error = KVTransferError(answer.request_id, refusal)
        self._kv_failed(TransferFailure(answer.request_id, "recv", error))

    # -- results ----------------------------------------------------------------------------------
    def _finish(self, finished: DecodeFinished) -> None:
        request = finished.request
        track = self._tracks.pop(request.request_id, None) or _Track(time.monotonic())
        if self.drafter is not None:
            self.drafter.forget(request.request_id)
        self.runner.forget_guide(request.request_id)
        self._guided.discard(request.request_id)
        if track.transfer is not None:
            self._transfers.pop(track.transfer.key, None)
        self._stream_new_tokens(request, track, time.time())
        result = self._result(request.request_id, request, track, finished.finish_reason, finished.error)
        self._report(track, result)
        self._write_back(finished)

    def _write_back(self, finished: DecodeFinished) -> None:
        """A finished request's full pages (prompt and output) to the shared store, so the next
        turn of its conversation finds its whole prefix wherever it is routed. The bytes are
        read now, before any later step can reuse the pages; the writes go on in the
        background."""
        copier = self.writeback
        if copier is None or finished.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
            return
        size = self.scheduler.config.page_size
        request = finished.request
        chain = prompt_chain(request.all_token_ids[: finished.num_computed_tokens], size, request.cache_salt)
        for page_id, link in zip(finished.page_ids, chain, strict=False):
            copier.tiers.computed(page_id, link)
        copier.run(copier.tiers.take_ops())

    def _result(
        self, request_id: str, request: Request | None, track: _Track, reason: FinishReason, error: str | None
    ) -> RequestResult:
        tokens = tuple(request.output_token_ids) if request is not None else ()
        bill = track.bill(request, time.monotonic())
        result = RequestResult(request_id, tokens, reason, bill, self.rank_id, track.prefill_rank, error)
        if request is None:
            return result
        sampling = request.sampling
        if sampling.logprobs is None and sampling.prompt_logprobs is None:
            return result
        prompt = tuple(request.prompt_logprobs) if sampling.prompt_logprobs is not None else ()
        logprobs = tuple(request.output_logprobs_from(0))
        return dataclasses.replace(result, logprobs=logprobs, prompt_logprobs=prompt)

    def _report(self, track: _Track, result: RequestResult) -> None:
        self.streams.result(track.routing.frontend, result)

    def _stream_new_tokens(self, request: Request, track: _Track, now_unix_s: float) -> None:
        frontend = track.routing.frontend
        outputs = request.output_token_ids
        if frontend is None or len(outputs) <= track.streamed:
            return
        new = tuple(outputs[track.streamed :])
        known = track.token_at[track.streamed : len(outputs)]
        at = tuple(known) + (time.monotonic(),) * (len(new) - len(known))
        logprobs = request.output_logprobs_from(track.streamed)
        wanted = request.sampling.prompt_logprobs is not None and track.streamed == 0
        prompt = request.prompt_logprobs if wanted else ()
        streamed = track.streamed
        self.streams.tokens(frontend, request.request_id, streamed, new, at, now_unix_s, logprobs, prompt)
        track.streamed = len(outputs)


def _notified_logprobs(
    request_id: str, raw: dict[str, Any] | None
) -> tuple[TokenLogprobs | None, tuple[TokenLogprobs | None, ...]]:
    """The first output's and the prompt's logprobs a notification carries (``wire/logprobs``);
    ``KVNotificationError`` naming the field when they are malformed."""
    if raw is None:
        return None, ()
    try:
        output = parse_all(raw.get("output"), "logprobs.output")
        prompt = parse_all(raw.get("prompt"), "logprobs.prompt")
    except ValueError as error:
        raise KVNotificationError(request_id, "logprobs", str(error)) from None
    if len(output) > 1:
        raise KVNotificationError(request_id, "logprobs.output", f"{len(output)} entries for one token")
    return (output[0] if output else None), prompt
