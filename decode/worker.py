"""A decode rank's work, without the threads and collectives around it: the I/O around its
scheduler.

The decode rank owns a request from routing to its end::

    submit -> queue -> reserve pages -> PrefillJob to a prefill rank (expect its KV)
           -> KV arrives (first token) -> running batch, one token a step -> finished + bill
    a failed or late transfer: abort it, then retry on another prefill rank or end with an error

Each request is one record, ``DecodeRequest`` (``decode_request.py``), which the scheduler owns:
its state, pages, reservation, transfer, stream position and the clock readings of its bill.
This worker moves data for it: prefill jobs out through the dispatcher, KV in through the
transport, steps through the runner and drafter, tokens and results out through the stream
publisher. A request submitted with a :class:`Routing` goes first to the prefill rank its
router chose, and its tokens are streamed: every new token (with its wall-clock time) and
finally its result are gathered per frontend and pushed in :meth:`publish`, one batch per
frontend per loop iteration. Requests without a frontend report through :meth:`take_results`.

``tick`` takes the KV that arrived, the transfers that failed, the reservations past their
deadline, then sends prefill jobs for new reservations, and holds out of the next step the
running guided requests whose grammar still compiles (``guide_wait.py``); ``step`` runs one
decode batch.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from tandem.decode.decode_request import DecodeRequest, Routing, admitted
from tandem.decode.guide_wait import grammars_held
from tandem.decode.rank_stats import decode_rank_stats
from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.slot_handoff import SlotHandoff
from tandem.decode.types import AbortAction, DecodeFinished, KVNotificationError, Reservation
from tandem.engine.drafter import Drafter
from tandem.engine.prefix_cache import prompt_chain
from tandem.engine.rank_loop import RankDraining
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.engine.speculation import SpeculativeConfig
from tandem.engine.stream_publisher import StreamPublisher
from tandem.engine.transfer_worker import TransferWorker
from tandem.engine.v4_runner import V4Runner
from tandem.kvtransfer.transport import KVTransport, ReceivedKV, TransferFailure
from tandem.kvtransfer.types import FailureCounts, KVTransferAborted, KVTransferError
from tandem.wire.logprobs import TokenLogprobs, parse_all
from tandem.wire.messages import (
    LoopStats,
    RankId,
    RankRequest,
    RankStats,
    RequestResult,
    Speculation,
    StreamBatch,
    TransferId,
)
from tandem.wire.prefill_job import PrefillJob, PrefillJobAnswer
from tandem.wire.request_params import FinishReason, InvalidRequestError

if TYPE_CHECKING:
    from tandem.engine.outbox import Outbox
    from tandem.engine.tier_copier import TierCopier
    from tandem.model.family import AnyConfig

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


class DecodeWorker(TransferWorker):
    def __init__(
        self,
        rank_id: RankId,
        incarnation: int,
        scheduler: DecodeScheduler,
        runner: ModelRunner | V4Runner,
        transport: KVTransport,
        dispatcher: PrefillDispatcher,
        kv_timeout_s: float = 30.0,
        model_config: AnyConfig | None = None,
        outbox: Outbox | None = None,
        speculative: SpeculativeConfig | None = None,
        drafter: Drafter | None = None,
        writeback: TierCopier | None = None,
        state_slots: int = 0,
    ) -> None:
        """``speculative`` with ``num_tokens`` > 0: each step verifies ``drafter``'s drafts.
        ``writeback``: the shared store's writer over this rank's pool; finished requests' pages
        go there. ``state_slots``: V4's state slots (``decode/slot_handoff.py``)."""
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
        # transport key -> the record whose current transfer it names, while that one is awaited
        self._transfers: dict[str, DecodeRequest] = {}
        self.slots = SlotHandoff(state_slots) if state_slots else None
        self.streams = StreamPublisher(rank_id)
        self.kv_bytes_received = 0
        self.preemptions = 0
        self.forks = 0  # requests started on another's prompt KV (``_fork``)
        self.failure_counts = FailureCounts()
        self._schedule_s = self._update_s = self._draft_s = 0.0
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
        return admitted(items, cfg, config.page_size, config.num_pages, time.monotonic())

    def submit(self, admitted: list[tuple[Request, Routing, float]]) -> None:
        now = time.monotonic()
        for request, routing, received in admitted:
            try:
                forked = routing.fork_of is not None and self._fork(request, routing.fork_of, now)
                record = self.scheduler.record(request.request_id) if forked else None
                if record is None:
                    record = self.scheduler.add_request(request)
            except InvalidRequestError as error:  # e.g. its id is in use here: it alone fails
                refused = DecodeRequest(request)
                refused.received(routing, received, now)
                self._report(refused, refused.result(None, self.rank_id, FinishReason.ERROR, str(error)))
                continue
            record.received(routing, received, now)
            if forked:
                record.fork_started(now)
            self.runner.prepare_guide(request.sampling)  # compiled while its KV is computed
            record.guide_pending = request.sampling.guide is not None

    def _fork(self, request: Request, parent_id: str, now: float) -> bool:
        """Start ``request`` on the prompt KV of ``parent_id`` (``DecodeScheduler.fork``): its
        pages copied before the next step, its bill one attempt with every prompt token but the
        last cached on this rank's device and no transfer. Not with a drafter (an MTP draft
        needs the prompt's last hidden state, which only a prefill gives) nor for prompt
        logprobs (a prefill computes them)."""
        if self.drafter is not None or self.slots is not None or request.sampling.prompt_logprobs is not None:
            return False  # (nor of a V4 request: its state beside its pages is not copied)
        copies = self.scheduler.fork(request, parent_id)
        if copies is None:
            return False
        assert self.runner.pool is not None
        self.runner.pool.copy_pages(copies)
        self.forks += 1
        return True

    def abort(self, request_id: str) -> None:
        record = self.scheduler.record(request_id)
        result = self.scheduler.abort(request_id)
        transfer = record.transfer if record is not None else None
        if result.action is AbortAction.CANCEL_TRANSFER and transfer is not None:
            self.transport.abort_receive(transfer.key)
        elif result.finished is not None:
            self._finish(result.finished)

    def abort_frontend(self, frontend: str) -> int:
        """Abort every request of a frontend that is gone; how many."""
        ids = [r.request_id for r in self.scheduler.records() if r.routing.frontend == frontend]
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
        self._held, failed = grammars_held(self.scheduler, self.runner.guide_ready)
        for finished in failed:
            self._finish(finished)

    def step(self) -> None:
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(self._draft_room(), self._held)
        self._schedule_s += time.perf_counter() - t0
        preempted_at = time.monotonic()
        for request_id in plan.preempted_request_ids:  # back in the queue, to be recomputed
            self.preemptions += 1
            if self.drafter is not None:
                self.drafter.forget(request_id)
            if (record := self.scheduler.record(request_id)) is not None:
                record.preempted(preempted_at)
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
        held = [(c, d) for c in plan.chunks if (d := self.scheduler.record(c.request_id)) is not None]
        before = [len(d.request.output_token_ids) for _, d in held]
        finished = self.scheduler.update(plan, sampled)
        for (chunk, record), count in zip(held, before, strict=True):
            request = record.request
            given = len(request.output_token_ids) - count
            if given <= 0:
                continue
            proposed = len(chunk.draft_token_ids)
            self.speculation = self.speculation.plus(proposed, record.stepped(now, proposed, given))
            if self.metrics is not None and self.speculative.enabled:
                self.metrics.spec_step_tokens.observe(given)
            if request.sampling.logprobs is not None:
                request.record_output_logprobs(given, self.runner.logprobs.get(request.request_id, []))
            if self.drafter is not None and not request.is_finished:
                needs = self.drafter.needs_hidden
                hidden = self.runner.hidden_rows(request.request_id, given) if needs else None
                self.drafter.observe(request.request_id, request.output_token_ids[-given:], hidden)
            stream_delta(self.streams, record, now_unix_s)
        for done in finished:
            self._finish(done)
        self._update_s += time.perf_counter() - t1

    def _draft_room(self) -> dict[str, int]:
        """The drafts each running request may have this step (none without speculation, and
        none for a structured output: its drafts are not checked against its grammar)."""
        if self.drafter is None:
            return {}
        k = self.speculative.num_tokens
        return {r.request_id: 0 if r.sampling.guide else k for r in self.scheduler.running_requests()}

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
        for record in self.scheduler.records():
            if record.ended:
                continue
            result = record.result(record.request, self.rank_id, FinishReason.ERROR, reason)
            self._report(record, dataclasses.replace(result, rank_failure=reason))
            record.ended = True
            if self.drafter is not None:
                self.drafter.forget(record.request_id)
        return self.take_results()

    def stats(self, loop: LoopStats) -> RankStats:
        return decode_rank_stats(self, loop)

    def step_times(self) -> tuple[float, float, float]:
        """Seconds of its steps spent planning, applying the tokens, and drafting."""
        return self._schedule_s, self._update_s, self._draft_s

    def close(self) -> None:
        if self.writeback is not None:
            self.writeback.tiers.close()

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        stray = self.slots.stray(set(self._transfers)) if self.slots is not None else set()
        if stray:
            raise AssertionError(
                f"decode rank {self.name}: state slots of no awaited transfer: {sorted(stray)}"
            )

    # -- tick's steps -----------------------------------------------------------------------------
    def _kv_arrived(self, got: ReceivedKV) -> None:
        record = self._transfers.pop(got.notification.request_id, None)
        if record is None or record.transfer is None:  # a transfer this rank no longer waits for
            return
        transfer, n = record.transfer, got.notification
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
            self._transfers[n.request_id] = record
            self._kv_failed(TransferFailure(n.request_id, "recv", KVTransferError(n.request_id, str(error))))
            return
        self.kv_bytes_received += n.kv_bytes
        taken = self.slots.arrived(transfer.key) if self.slots is not None else None
        request = self.scheduler.get(transfer.request_id)
        if taken is not None and request is not None and not request.is_finished:
            assert isinstance(self.runner, V4Runner)  # takes the request on from its slot and pages
            self.runner.adopt(transfer.request_id, taken[0], taken[1], taken[2])
        usable = time.monotonic()  # the KV is the request's: it decodes from the next step
        if not record.ended:
            attempt = record.kv_delivered(n, got.stats.end_s, usable)
            if self.metrics is not None:
                self.metrics.kv_transfer_exposed_seconds.observe(attempt.kv_transfer_exposed_s)
        request = self.scheduler.get(transfer.request_id)
        if self.drafter is not None and request is not None and not request.is_finished:
            self.drafter.start(transfer.request_id, n.draft_state)
        if request is not None and not record.ended:
            stream_delta(self.streams, record, time.time())
        if finished is not None:
            self._finish(finished)

    def _kv_failed(self, failure: TransferFailure) -> None:
        if failure.role != "recv":
            return
        if self.slots is not None:  # the receive is over: nothing more lands in its slot
            self.slots.over(failure.request_id)
        self.failure_counts.add("recv", failure.error)
        record = self._transfers.pop(failure.request_id, None)
        if record is None or record.transfer is None:
            return
        transfer = record.transfer
        record.kv_lost(str(failure.error), time.monotonic())
        retry = not isinstance(failure.error, KVTransferAborted) or "prefill" in failure.error.by
        finished = self.scheduler.kv_failed(
            transfer.request_id, str(failure.error), retry, attempt=transfer.attempt
        )
        if finished is not None:
            self._finish(finished)

    def _abort_expired(self, now: float) -> None:
        for request_id in self.scheduler.expired(now):
            record = self.scheduler.record(request_id)
            if record is not None and record.transfer is not None:
                self.transport.abort_receive(record.transfer.key)

    def _send_prefill_job(self, reservation: Reservation) -> None:
        record = self.scheduler.record(reservation.request_id)
        assert record is not None
        request = record.request
        transfer = TransferId(request.request_id, reservation.attempt)
        # the router's choice holds for the first attempt; a retry goes where this rank likes
        preferred = record.routing.prefill_rank if reservation.attempt <= 1 else None
        prefill_rank = self.dispatcher.choose(request, preferred)
        record.job_sent(transfer, prefill_rank, reservation.num_prompt_tokens, time.monotonic())
        self._transfers[transfer.key] = record
        destination = reservation.destination(self.name, self.incarnation)
        if self.slots is not None:
            reserved = self.slots.reserve(transfer.key, destination, reservation.num_prompt_tokens)
            if reserved is None:  # every slot awaits a transfer: this attempt fails and is retried
                error = KVTransferError(transfer.key, f"decode rank {self.name}: every state slot is awaited")
                self._kv_failed(TransferFailure(transfer.key, "recv", error))
                return
            destination = reserved
        self.transport.expect(transfer.key, prefill_rank.name, reservation.page_ids, self.kv_timeout_s)
        job = record.prefill_job(destination, self.kv_timeout_s)
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
        request, record = finished.request, finished.record
        assert record is not None
        if self.drafter is not None:
            self.drafter.forget(request.request_id)
        self.runner.forget(request.request_id)
        if record.transfer is not None:
            self._transfers.pop(record.transfer.key, None)
        if not record.ended:
            stream_delta(self.streams, record, time.time())
            self._report(record, record.result(request, self.rank_id, finished.finish_reason, finished.error))
        write_back(self.writeback, self.scheduler.config.page_size, finished)

    def _report(self, record: DecodeRequest, result: RequestResult) -> None:
        self.streams.result(record.routing.frontend, result)


def stream_delta(streams: StreamPublisher, record: DecodeRequest, now_unix_s: float) -> None:
    """Its outputs its frontend has not had, onto this loop's push."""
    delta, frontend = record.new_tokens(), record.routing.frontend
    if delta is not None and frontend is not None:
        start, ids, at, logprobs, prompt = delta
        streams.tokens(frontend, record.request_id, start, ids, at, now_unix_s, logprobs, prompt)


def write_back(copier: TierCopier | None, page_size: int, finished: DecodeFinished) -> None:
    """A finished request's full pages (prompt and output) to the shared store, so the next turn
    of its conversation finds its whole prefix wherever it is routed. The bytes are read now,
    before any later step can reuse the pages; the writes go on in the background."""
    if copier is None or finished.finish_reason not in (FinishReason.STOP, FinishReason.LENGTH):
        return
    request = finished.request
    chain = prompt_chain(request.all_token_ids[: finished.num_computed_tokens], page_size, request.cache_salt)
    for page_id, link in zip(finished.page_ids, chain, strict=False):
        copier.tiers.computed(page_id, link)
    copier.run(copier.tiers.take_ops())


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
