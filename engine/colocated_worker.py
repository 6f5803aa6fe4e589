"""A colocated rank's worker: the colocated engine in the one rank loop, prefill and decode over
one KV pool. Requests come in as :class:`RankRequest`; with ``frontend`` set, their tokens and
results are pushed to that frontend as they come (as a decode rank does), otherwise the results
leave through ``collect``. Its prefix cache's KV events go to the frontends that subscribed, so
their routers send a conversation back to the rank that holds it.

A request's bill has one attempt, on this rank, with no transfer: ``prefill_queue_s`` (on the
loop -> first chunk scheduled) and ``prefill_compute_s`` (first chunk scheduled -> first token);
``decode_s`` is first token -> finished. Each is the difference of two readings of this
process's monotonic clock.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tandem.engine.admission import request_of
from tandem.engine.bill_builder import build_bill
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.dep import ExpertParallelDispatcher
from tandem.engine.kv_event_publisher import KVEventPublisher
from tandem.engine.rank_loop import RankDraining, RankWorker
from tandem.engine.request import Request
from tandem.engine.stream_publisher import StreamPublisher
from tandem.wire.kv_events import KVEventBatch
from tandem.wire.logprobs import TokenLogprobs
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
    TierStats,
)
from tandem.wire.request_params import FinishReason, InvalidRequestError

if TYPE_CHECKING:
    from tandem.engine.outbox import Outbox


@dataclass
class _Track:
    """What the worker measures of one request, on this process's monotonic clock."""

    received: float  # the actor took it
    frontend: str | None
    queued_at: float = 0.0  # on the loop
    scheduled_at: float | None = None  # its first chunk
    streamed: int = 0  # outputs already pushed (a resumed request's are its client's already)
    token_at: list[float] = field(default_factory=list)  # when each new output was known


class ColocatedWorker(RankWorker):
    def __init__(
        self,
        rank_id: RankId,
        incarnation: int,
        engine: ColocatedEngine,
        dispatcher: ExpertParallelDispatcher,
        outbox: Outbox | None = None,
    ) -> None:
        self.rank_id, self.incarnation, self.name = rank_id, incarnation, rank_id.name
        self.engine = engine
        self.dispatcher = dispatcher
        self.outbox = outbox
        self.kv_events = KVEventPublisher(rank_id, engine.scheduler.config.page_size, incarnation)
        self._schedule_s = self._update_s = 0.0
        self._tracks: dict[str, _Track] = {}
        # guided requests whose grammar still compiles: they join the scheduler once it is ready
        # (a step, and so the DEP group, never waits for a compile)
        self._grammar_wait: dict[str, tuple[Request, bool]] = {}
        self.streams = StreamPublisher(rank_id)

    # ---- requests -------------------------------------------------------------------------
    def admit(self, items: list[RankRequest]) -> list[tuple[Request, str | None, float]]:
        """Requests built and checked against this rank's limits: one that could never run
        fails here, alone, instead of on the loop."""
        if self.draining:
            raise RankDraining(self.name)
        engine, config = self.engine, self.engine.scheduler.config
        cfg = engine.model_config
        eos = frozenset(cfg.eos_token_ids)
        received = time.monotonic()
        admitted = []
        for r in items:
            limit = engine.max_model_len
            request = request_of(r, cfg.vocab_size, eos, limit, config.page_size, config.num_pages)
            admitted.append((request, r.frontend, received))
        return admitted

    def submit(self, admitted: list[tuple[Request, str | None, float]]) -> None:
        now = time.monotonic()
        for request, frontend, received in admitted:
            request.arrival_s = now
            resumed = bool(request.output_token_ids)
            rid = request.request_id
            if rid in self._grammar_wait or self.engine.scheduler.get_request(rid) is not None:
                raise InvalidRequestError("request_id", f"{rid!r} is already in use")
            if request.sampling.guide is None:
                self.engine.scheduler.add_request(request, resumed=resumed)
            else:
                self._grammar_wait[request.request_id] = (request, resumed)
            self.engine.runner.prepare_guide(request.sampling)
            track = _Track(received, frontend, queued_at=now, streamed=len(request.output_token_ids))
            self._tracks[request.request_id] = track
        self._queue_ready_grammars()

    def _queue_ready_grammars(self) -> None:
        """Guided requests join the scheduler once their grammar is compiled; one whose grammar
        did not compile, or not within the limit, ends with the error."""
        for request_id, (request, resumed) in list(self._grammar_wait.items()):
            try:
                if not self.engine.runner.guide_ready(
                    request_id, request.sampling, self._tracks[request_id].received
                ):
                    continue
            except InvalidRequestError as error:
                del self._grammar_wait[request_id]
                self.engine.runner.forget(request_id)
                self._finish(request, FinishReason.ERROR, str(error))
                continue
            del self._grammar_wait[request_id]
            self.engine.scheduler.add_request(request, resumed=resumed)

    def abort(self, request_id: str) -> None:
        held = self._grammar_wait.pop(request_id, None)
        if held is not None:
            self.engine.runner.forget(request_id)
            self._finish(held[0], FinishReason.ABORT)
            return
        request = self.engine.scheduler.get_request(request_id)
        if request is not None and self.engine.abort(request_id):
            self._finish(request, request.finish_reason or FinishReason.ABORT)

    def abort_frontend(self, frontend: str) -> int:
        """Abort every request of a frontend that is gone; how many."""
        ids = [rid for rid, track in self._tracks.items() if track.frontend == frontend]
        for request_id in ids:
            self.abort(request_id)
        return len(ids)

    # ---- the loop ---------------------------------------------------------------------------
    def tick(self) -> None:
        self._queue_ready_grammars()

    def has_work(self) -> bool:
        return self.engine.scheduler.has_work()

    def step(self) -> None:
        scheduler = self.engine.scheduler
        t0 = time.perf_counter()
        plan = scheduler.schedule()
        self.engine.run_tier_ops()  # host and store blocks into their pages, before the forward
        self._schedule_s += time.perf_counter() - t0
        scheduled_at = time.monotonic()
        for chunk in plan.chunks:
            track = self._tracks.get(chunk.request_id)
            if track is not None and track.scheduled_at is None:
                track.scheduled_at = scheduled_at
        requests = [r for r in (scheduler.get_request(c.request_id) for c in plan.chunks) if r is not None]
        before = [len(r.output_token_ids) for r in requests]
        runner = self.engine.runner
        sampled = runner.run(plan)
        t1 = time.perf_counter()
        finished = scheduler.update(plan, sampled, runner.logprobs, runner.prompt_logprobs)
        self.engine.run_tier_ops()  # what the forward computed, to the store
        now, now_unix_s = time.monotonic(), time.time()
        for request, count in zip(requests, before, strict=True):
            track = self._tracks.get(request.request_id)
            if track is not None and len(request.output_token_ids) > count:  # one timestamp a token
                track.token_at.append(now)
                self._stream_new_tokens(request, track, now_unix_s)
        for request in finished:
            self._finish(request, request.finish_reason or FinishReason.ABORT)
            runner.forget(request.request_id)
        self._update_s += time.perf_counter() - t1

    def take_results(self) -> list[RequestResult]:
        return self.streams.take_results()

    def publish(self) -> None:
        """Push each frontend its tokens and results, and each subscriber its KV events; a
        frontend that is gone loses its requests (aborted) and its subscription."""
        events = self.engine.scheduler.kv_cache.take_events()
        if self.outbox is None:
            return
        for frontend in self.streams.publish(self.outbox):
            self.abort_frontend(frontend)
        for subscriber, events_batch in self.kv_events.publish(events).items():
            if not self.outbox.push_kv_events(subscriber, events_batch):
                self.kv_events.unsubscribe(subscriber)

    def subscribe(self, subscriber: str) -> KVEventBatch:
        """Send this rank's KV events to the named actor from now on; the snapshot."""
        return self.kv_events.subscribe(subscriber, self.engine.scheduler.kv_cache.cached_block_hashes())

    def unsubscribe(self, subscriber: str) -> None:
        self.kv_events.unsubscribe(subscriber)

    def set_peers(self, peers: dict[Any, Any]) -> None:
        """A colocated rank sends work to no other rank: membership changes nothing here."""

    def fail_all(self, reason: str) -> list[RequestResult]:
        scheduler = self.engine.scheduler
        for request in scheduler.unfinished_requests():
            scheduler.abort_request(request.request_id)
            self.engine.runner.forget(request.request_id)
            self._finish(request, FinishReason.ERROR, reason, rank_failure=True)
        for request, _ in self._grammar_wait.values():
            self._finish(request, FinishReason.ERROR, reason, rank_failure=True)
        self._grammar_wait.clear()
        return self.take_results()  # pushed results leave with the loop's last publish

    def stats(self, loop: LoopStats) -> RankStats:
        scheduler, ep = self.engine.scheduler, self.dispatcher.stats
        return RankStats(
            rank=self.rank_id,
            role=Role.COLOCATED,
            incarnation=self.incarnation,
            loop=loop,
            queued=scheduler.num_waiting,
            running=scheduler.num_running,
            free_pages=scheduler.kv_cache.num_free_pages,
            total_pages=scheduler.kv_cache.num_total_pages,
            cached_pages=scheduler.kv_cache.num_cached_pages,
            local_experts=len(self.dispatcher.local),
            weight_bytes=self.engine.runner.weight_bytes,
            forward_s=self.engine.runner.stats.forward_s,
            split=self.engine.runner.split(self._schedule_s, self._update_s),
            tiers=self.engine.copier.tiers.stats() if self.engine.copier is not None else TierStats(),
            all_to_all_s=ep.all_to_all_s,
            moe_rows_sent=ep.rows_sent,
            moe_rows_received=ep.rows_received,
        )

    def close(self) -> None:
        if self.engine.copier is not None:
            self.engine.copier.tiers.close()

    def check_integrity(self) -> None:
        self.engine.scheduler.check_integrity()

    # ---- streams and bills ------------------------------------------------------------------
    def _stream_new_tokens(self, request: Request, track: _Track, now_unix_s: float) -> None:
        outputs = request.output_token_ids
        if track.frontend is None or len(outputs) <= track.streamed:
            return
        new = tuple(outputs[track.streamed :])
        times = tuple(track.token_at[-len(new) :])
        logprobs = request.output_logprobs_from(track.streamed)
        streamed = track.streamed
        prompt = _prompt_logprobs(request) if streamed == 0 else ()
        self.streams.tokens(
            track.frontend, request.request_id, streamed, new, times, now_unix_s, logprobs, prompt
        )
        track.streamed = len(outputs)

    def _finish(
        self, request: Request, reason: FinishReason, error: str | None = None, rank_failure: bool = False
    ) -> None:
        """Report how ``request`` ended; ``rank_failure``: this rank failed, not the request."""
        track = self._tracks.pop(request.request_id, None)
        now = time.monotonic()
        result = RequestResult(
            request.request_id,
            tuple(request.output_token_ids),
            reason,
            self._bill(request, track, now) if track is not None else Bill(),
            self.rank_id,
            self.rank_id if track is not None and track.token_at else None,
            error=error,
            rank_failure=error if rank_failure else None,
            logprobs=tuple(request.output_logprobs_from(0)),
            prompt_logprobs=_prompt_logprobs(request),
        )
        self.streams.result(track.frontend if track is not None else None, result)

    def _bill(self, request: Request, track: _Track, now: float) -> Bill:
        first = track.token_at[0] if track.token_at else None
        scheduled = track.scheduled_at
        host, store = request.num_cached_host_tokens, request.num_cached_store_tokens
        cached = CachedByTier(request.num_cached_tokens - host - store, host, store)
        attempt = PrefillAttempt(
            attempt=1,
            prefill_rank=self.rank_id,
            delivered=first is not None,
            prompt_tokens=request.num_prompt_tokens,
            cached_tokens=request.num_cached_tokens,
            cached_by_tier=cached,
            prefill_queue_s=(scheduled if scheduled is not None else now) - track.queued_at,
            prefill_compute_s=(first - scheduled) if first is not None and scheduled is not None else 0.0,
        )
        return build_bill(
            cached_by_tier=cached,
            prompt_tokens=request.num_prompt_tokens,
            cached_tokens=request.num_cached_tokens,
            new_prompt_tokens=request.num_prompt_tokens - request.num_cached_tokens,
            output_tokens=len(request.output_token_ids),
            preemptions=request.num_preemptions,
            attempts=(attempt,),
            arrival=track.received,
            token_at=track.token_at,
            now=now,
            pickup_s=track.queued_at - track.received,
            decode_s=(now - first) if first is not None else 0.0,
        )


def _prompt_logprobs(request: Request) -> tuple[TokenLogprobs | None, ...]:
    """A request's prompt logprobs for its result, when it asked (a one-token prompt's: ``None``)."""
    if request.sampling.prompt_logprobs is None:
        return ()
    return tuple(request.prompt_logprobs) or (None,)
