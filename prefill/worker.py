"""A prefill rank's work, without the threads and collectives around it: jobs in, KV out.

Jobs come from decode ranks. Each is answered as soon as it reaches the loop (``submit``):
taken, or refused with why (its id in use, it can never fit this rank's pool, this rank holds
``max_jobs`` already), so that the decode rank frees the pages it reserved for a refused job
at once instead of at its KV deadline. One ``step`` plans a
batch (:class:`PrefillScheduler`), opens a transfer for every job whose last chunk is in it, runs
the model with a per-layer hook that posts each layer's writes as soon as that layer's KV is in
the pool (layer-wise mode), samples the first tokens and hands the notifications to the
transport. ``tick`` polls the transport and gives a job's pages back once its transfer is over;
it also queues a guided job once its grammar is compiled (until then it holds no page and the
jobs behind it go first: a step never waits for a compile).
With ``whole`` transfers every layer goes at the end, in one transfer. ``publish`` pushes the
prefix cache's KV events to the frontends that subscribed.

The job's figures, each on this rank's monotonic clock, travel in its notification: pickup
(received by the actor -> queued on the loop), queue (-> first chunk scheduled), compute (-> the
last layer's KV in the pool); the transport adds the transfer's own. On a GPU a layer's writes
are posted only once its kernels have run: the hook hands the transport a CUDA event recorded
after them (``ModelRunner.kv_event``), which the transport's own thread waits for, posting the
layer's writes as soon as it completes while the forward goes on; the step never waits for it.
On a CPU the forward is synchronous and the event is complete at once.

Where the compute figure ends: the step knows only when the host queued the last layer (the
hook's time), which on a GPU is well before the device ran it. The one who sees the device's
completion is the transport's watcher, which stamps it before it posts that layer, and the
notification is sent only after that. So the step hands the transport the host's time
(``finish_send``'s ``compute_done_s``, where ``prefill_compute_s`` also ends) and the transport
moves both to the stamp: no wait on the loop thread for a stamp that may not be taken yet, and
on a CPU (events complete when handed over) the figures are the step's own.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from tandem.engine.kv_event_publisher import KVEventPublisher
from tandem.engine.runner import ModelRunner
from tandem.engine.slot_owners import SlotOwners
from tandem.engine.transfer_worker import TransferWorker
from tandem.engine.v4_runner import V4Runner
from tandem.kvtransfer.transport import KVTransport, TransferFailure
from tandem.kvtransfer.types import (
    READY,
    FailureCounts,
    KVNotification,
    KVTransferError,
    ReadyEvent,
    SenderTimings,
    TransferStats,
)
from tandem.prefill.scheduler import AbortAction, PrefillScheduler
from tandem.wire.kv_events import KVEventBatch
from tandem.wire.logprobs import TokenLogprobs, encode_all
from tandem.wire.messages import LoopStats, RankId, RankStats, RequestResult, Role, TierStats
from tandem.wire.prefill_job import PrefillJob, PrefillJobAnswer
from tandem.wire.request_params import InvalidRequestError

if TYPE_CHECKING:
    from tandem.engine.outbox import Outbox
    from tandem.engine.tier_copier import TierCopier
    from tandem.model.family import AnyConfig

log = logging.getLogger(__name__)

_REFUSALS_KEPT = 4096  # refused job ids remembered for their decode rank's cancel that follows


class PrefillWorker(TransferWorker):
    def __init__(
        self,
        rank_id: RankId,
        incarnation: int,
        scheduler: PrefillScheduler,
        runner: ModelRunner | V4Runner,
        transport: KVTransport,
        layerwise: bool = True,
        transfer_timeout_s: float = 30.0,
        model_config: AnyConfig | None = None,
        outbox: Outbox | None = None,
        copier: TierCopier | None = None,
        max_jobs: int | None = None,
        state_slots: int = 0,
    ) -> None:
        """``max_jobs``: the most jobs this rank holds at once (queued, computing or sending);
        one more is refused. ``None``: no limit. ``state_slots``: V4's, held by a send until it is over."""
        self.rank_id, self.incarnation, self.name = rank_id, incarnation, rank_id.name
        self.model_config = model_config
        self.outbox = outbox
        self.kv_events = KVEventPublisher(rank_id, scheduler.config.page_size, incarnation)
        self.copier = copier  # the copies of the host tier and the store, when the rank has them
        self.scheduler = scheduler
        self.runner = runner
        self.transport = transport
        self.layerwise = layerwise
        self.transfer_timeout_s = transfer_timeout_s
        self.kv_bytes_sent = 0
        self.max_jobs = max_jobs
        self.slots = SlotOwners(state_slots) if state_slots else None
        self.cancelled_jobs = 0  # jobs dropped uncomputed because their decode rank gave up
        self.refused_jobs = 0  # jobs answered with a refusal
        # refused jobs, newest last: the receive their decode rank then gives up is confirmed at once
        self._refused: OrderedDict[str, None] = OrderedDict()
        self._jobs: dict[str, PrefillJob] = {}
        self._pickup_s: dict[str, float] = {}  # job -> received by the actor -> queued on the loop
        # guided jobs whose grammar still compiles -> when they reached the loop: they join the
        # scheduler's queue once it is ready (the step never waits for a compile)
        self._grammar_wait: dict[str, float] = {}
        # job -> its prompt positions' logprobs so far, chunk by chunk (a job that asked for them)
        self._prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}
        self.sent: list[TransferStats] = []
        self.failures: list[TransferFailure] = []
        self.failure_counts = FailureCounts()

    def admit(self, items: list[PrefillJob]) -> list[tuple[PrefillJob, float]]:
        """The jobs, each with the moment this rank received it; each is checked on the loop,
        where it is answered (``submit``)."""
        if self.model_config is None:
            raise RuntimeError(f"prefill rank {self.name} was built without a model config")
        received = time.monotonic()
        return [(job, received) for job in items]

    def submit(self, jobs: list[tuple[PrefillJob, float]]) -> list[PrefillJobAnswer]:
        """Queue jobs, each answered: taken, or refused with why. A job's ``deadline_s`` is
        wall-clock time (it crosses machines) and is turned into this process's monotonic clock
        here."""
        now, wall = time.monotonic(), time.time()
        answers = [self._take(job, received, now, wall) for job, received in jobs]
        self._queue_ready_grammars()
        return answers

    def _take(self, job: PrefillJob, received: float, now: float, wall: float) -> PrefillJobAnswer:
        if self.transport.is_cancelled(job.request_id):  # given up before it arrived
            self.cancelled_jobs += 1
            self.transport.confirm_cancelled(job.request_id)
            return PrefillJobAnswer(job.request_id, self.name, "its decode rank gave it up before it came")
        refusal = self._refusal(job)
        if refusal is not None:
            log.warning("prefill job %s refused: %s", job.request_id, refusal)
            self.refused_jobs += 1
            self._refused[job.request_id] = None
            if len(self._refused) > _REFUSALS_KEPT:
                self._refused.popitem(last=False)
            return PrefillJobAnswer(job.request_id, self.name, refusal)
        job = dataclasses.replace(job, deadline_s=now + (job.deadline_s - wall))
        self.runner.prepare_guide(job.sampling)  # compiled while its prompt waits or runs
        self._jobs[job.request_id] = job
        self._pickup_s[job.request_id] = now - received
        if job.sampling.guide is None:
            self._queue(job, now)
        else:
            self._grammar_wait[job.request_id] = now
        return PrefillJobAnswer(job.request_id, self.name)

    def _refusal(self, job: PrefillJob) -> str | None:
        """Why this rank does not take ``job`` now; ``None`` when it does."""
        if self.max_jobs is not None and len(self._jobs) >= self.max_jobs:
            return f"prefill rank {self.name} is full: it holds {len(self._jobs)} jobs, its most"
        if job.request_id in self._jobs:
            return f"request_id: {job.request_id!r} is already in use on this rank"
        error = self.scheduler.refusal(job)  # what ``add_job`` would refuse
        return None if error is None else str(error)

    def _queue(self, job: PrefillJob, now: float) -> None:
        try:
            self.scheduler.add_job(job, now)
        except InvalidRequestError as error:  # answered taken, so not expected: its decode rank times out
            log.warning("prefill job %s refused: %s", job.request_id, error)
            self._forget(job.request_id)

    def _queue_ready_grammars(self) -> None:
        """Guided jobs join the scheduler's queue once their grammar is compiled. One whose
        grammar did not compile, or not within the limit, joins too, its first token then EOS
        only (its decode rank ends the request with the error); one past its deadline is
        dropped (its decode rank gives up)."""
        now = time.monotonic()
        for request_id, queued_at in list(self._grammar_wait.items()):
            job = self._jobs[request_id]
            try:
                ready = self.runner.guide_ready(request_id, job.sampling, queued_at)
            except InvalidRequestError as error:
                log.warning("prefill job %s: %s; it samples EOS", request_id, error)
                ready = True
            if ready:
                del self._grammar_wait[request_id]
                self._queue(job, queued_at)
            elif now >= job.deadline_s:
                self._forget(request_id)

    def abort(self, request_id: str) -> None:
        if self.scheduler.abort(request_id) is AbortAction.ABORT_TRANSFER:
            self.transport.abort_send(request_id)
        else:
            self._forget(request_id)

    def peers_lost(self, ranks: list[str]) -> None:
        """Decode ranks whose group failed: nothing waits for their jobs' KV any more. Sends to
        them stop (their posted writes drained first); their jobs not yet sending are dropped."""
        lost = set(ranks)
        for rank in ranks:
            self.transport.fence_peer(rank)
        for request_id, job in list(self._jobs.items()):
            if job.destination.rank not in lost:
                continue
            if self.scheduler.abort(request_id) is not AbortAction.ABORT_TRANSFER:
                self._forget(request_id)  # a transferring one ends with its send's failure

    def _forget(self, request_id: str) -> None:
        if self.slots is not None:
            self.slots.release(request_id)
        self._jobs.pop(request_id, None)
        self._grammar_wait.pop(request_id, None)
        self._pickup_s.pop(request_id, None)
        self._prompt_logprobs.pop(request_id, None)
        self.runner.forget(request_id)

    def _logprobs_of(self, request_id: str) -> dict[str, Any] | None:
        """A finished job's logprobs for its notification (``wire/logprobs``): its first output's
        and its prompt's, where it asked (a one-token prompt's are ``[None]``)."""
        job = self._jobs.get(request_id)
        if job is None or (job.sampling.logprobs is None and job.sampling.prompt_logprobs is None):
            return None
        prompt = self._prompt_logprobs.pop(request_id, [None])
        wanted = job.sampling.prompt_logprobs is not None and not job.output_index
        return {
            "output": encode_all(self.runner.logprobs.get(request_id, ())),
            "prompt": encode_all(prompt) if wanted else None,
        }

    def pending(self) -> int:
        """Jobs this rank still holds (queued, computing or transferring)."""
        return len(self._jobs)

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def take_results(self) -> list[RequestResult]:
        """A prefill rank reports to decode ranks through the transport, not through results."""
        return []

    def fail_all(self, reason: str) -> list[RequestResult]:
        return []

    def subscribe(self, subscriber: str) -> KVEventBatch:
        """Send this rank's KV events to the named actor from now on; the snapshot."""
        cache = self.scheduler.kv_cache
        tiers = self.copier.tiers if self.copier is not None else None
        return self.kv_events.subscribe(
            subscriber,
            cache.cached_block_hashes(),
            tiers.host_blocks() if tiers else None,
            tiers.store_blocks() if tiers else None,
        )

    def unsubscribe(self, subscriber: str) -> None:
        self.kv_events.unsubscribe(subscriber)

    def publish(self) -> None:
        """Each subscriber's batch of KV events; one that is gone loses its subscription."""
        events = self.scheduler.take_events()
        if self.outbox is None:
            return
        for subscriber, batch in self.kv_events.publish(events).items():
            if not self.outbox.push_kv_events(subscriber, batch):
                self.kv_events.unsubscribe(subscriber)

    def stats(self, loop: LoopStats) -> RankStats:
        s = self.scheduler
        sends, receives = self.transport.in_flight()
        return RankStats(
            rank=self.rank_id,
            role=Role.PREFILL,
            incarnation=self.incarnation,
            loop=loop,
            queued=s.num_queued,
            computing=s.num_computing,
            pending_tokens=s.num_pending_tokens,
            transferring=s.num_transferring,
            free_pages=s.num_free_pages,
            total_pages=s.config.num_pages,
            cached_pages=s.kv_cache.num_cached_pages,
            kv_bytes_sent=self.kv_bytes_sent,
            sends_in_flight=sends,
            peers_connected=self.transport.connected_peers(),
            receives_in_flight=receives,
            prefix_queried_tokens=s.num_queried_tokens,
            prefix_hit_tokens=s.num_hit_tokens,
            transfer_failures=self.failure_counts.as_tuple(),
            weight_bytes=self.runner.weight_bytes,
            forward_s=self.runner.stats.forward_s,
            split=self.runner.split(),
            tiers=self.copier.tiers.stats() if self.copier is not None else TierStats(),
        )

    def check_integrity(self) -> None:
        self.scheduler.check_integrity()
        stray = self.slots.owners() - set(self._jobs) if self.slots is not None else set()
        if stray:
            raise AssertionError(f"prefill rank {self.name}: state slots held by no job: {sorted(stray)}")

    def close(self) -> None:
        if self.copier is not None:
            self.copier.tiers.close()

    def tick(self) -> None:
        """Poll the transport: a finished or failed send gives its pages back."""
        events = self.transport.poll()
        for stats in events.sent:
            self.scheduler.transfer_over(stats.request_id)
            self._forget(stats.request_id)
            self.kv_bytes_sent += stats.bytes
            self.sent.append(stats)
            if self.metrics is not None:
                self.metrics.kv_transfer_seconds.observe(stats.duration_s)
        for failure in events.failed:
            if failure.role == "send":
                self.scheduler.transfer_over(failure.request_id)
                self._forget(failure.request_id)
                self._failed(failure)
        for request_id in events.cancelled:  # its decode rank gave up before the send began
            if request_id in self._refused:  # refused on arrival: nothing of it ever ran
                del self._refused[request_id]
                self.transport.confirm_cancelled(request_id)
                continue
            held = request_id in self._grammar_wait
            if held or self.scheduler.abort(request_id) in (AbortAction.DEQUEUED, AbortAction.STOPPED):
                self._forget(request_id)
                self.cancelled_jobs += 1
                self.transport.confirm_cancelled(request_id)
            # not here yet: refused on arrival (``submit``)
        for expired in self.scheduler.take_expired():
            self._forget(expired.request_id)
        self._queue_ready_grammars()

    def _failed(self, failure: TransferFailure) -> None:
        self.failures.append(failure)
        self.failure_counts.add("send", failure.error)

    def step(self) -> None:
        """One step; with nothing planned the model still runs on an empty batch when the runner
        is one of a DEP group (its MoE layers serve the other ranks)."""
        now = time.monotonic()
        plan = self.scheduler.schedule(now)
        copier = self.copier
        if copier is not None:  # host and store blocks into their pages, before the forward reads them
            copier.run(copier.tiers.take_ops())
        finishing: list[str] = []
        for chunk in plan.chunks:
            if not chunk.sample:
                continue
            job = self._jobs[chunk.request_id]
            try:
                slot = self.slots.sending(chunk.request_id, self.name) if self.slots is not None else None
                self.transport.begin_send(
                    chunk.request_id, job.destination, chunk.page_ids, self.transfer_timeout_s, slot
                )
                finishing.append(chunk.request_id)
            except KVTransferError as error:  # e.g. the decode rank restarted: nowhere to write
                self._failed(TransferFailure(chunk.request_id, "send", error))
        if not self.layerwise:
            for request_id in finishing:
                self.transport.send_all_layers(request_id)
        last_layer = self.runner.model.num_kv_layers - 1  # the MTP layer's, when it is computed
        kv_done: list[float] = []  # when the host queued the last layer's KV (see the docstring)
        last_ready: list[ReadyEvent] = []  # and its event, for whole-request writes

        def layer_kv(layer: int) -> None:
            if layer == last_layer:
                kv_done.append(time.monotonic())
            if self.layerwise:
                ready = self.runner.kv_event()  # the writes wait for it (the transport's thread does)
                for request_id in finishing:
                    self.transport.send_layer(request_id, layer, ready)
            elif layer == last_layer:
                last_ready.append(self.runner.kv_event())

        if self.metrics is not None:
            self.metrics.batch_tokens.observe(plan.num_batched_tokens)
        forward_start = time.monotonic()
        exports = {rid: slot for rid in finishing if self.slots and (slot := self.slots.get(rid)) is not None}
        sampled = self.runner.run(plan, layer_kv if finishing else None, exports)
        # once a chunk samples, its token is on the host and the device has run the whole forward
        # (a step of middle chunks only is the host's queueing time: the next step's waits cover it)
        forward_done = time.monotonic()
        compute_done = kv_done[0] if kv_done else forward_done
        for request_id, (_, entries) in self.runner.prompt_logprobs.items():  # chunks in order
            self._prompt_logprobs.setdefault(request_id, [None]).extend(entries)
        if copier is not None and plan.num_batched_tokens:  # recompute's price: the device's time
            copier.tiers.prices.observe("prefill", plan.num_batched_tokens, forward_done - forward_start)
        for done in self.scheduler.update(plan, sampled, compute_done):
            if done.request_id not in finishing:  # its transfer could not start
                self.scheduler.transfer_over(done.request_id)
                self._forget(done.request_id)
                continue
            timings = SenderTimings(
                prefill_pickup_s=self._pickup_s.get(done.request_id, 0.0),
                prefill_queue_s=done.timings.queue_s,
                prefill_compute_s=done.timings.compute_s,
            )
            notification = KVNotification(
                done.request_id,
                done.first_token,
                done.cached_tokens,
                timings,
                draft_state=self.runner.hidden_state(done.request_id) if self.runner.mtp_prefill else b"",
                cached_host_tokens=done.cached_host_tokens,
                cached_store_tokens=done.cached_store_tokens,
                logprobs=self._logprobs_of(done.request_id),
            )
            self.transport.finish_send(
                done.request_id, notification, compute_done, last_ready[0] if last_ready else READY
            )
        if copier is not None:  # the blocks this forward computed, to the store
            copier.run(copier.tiers.take_ops())
