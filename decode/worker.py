"""A decode rank's work, without the threads and collectives around it.

The decode rank owns a request from routing to its end::

    submit -> queue -> reserve pages -> PrefillJob to a prefill rank (expect its KV)
           -> KV arrives (first token) -> running batch, one token a step -> finished + bill
    a failed or late transfer: abort it, then retry on another prefill rank or end with an error

A request submitted with a :class:`Routing` goes first to the prefill rank its router chose, and
its tokens are streamed: every new token (with its wall-clock time) and finally its result are
gathered per frontend in :meth:`take_pushes`, one batch per frontend per loop iteration.
Requests without a frontend report through :meth:`take_results`.

``tick`` polls the transport, hands expired transfers to abort and sends prefill jobs for new
reservations; ``step`` runs one decode batch. Transfers are named ``<request>#<attempt>`` so a
retry never meets the notification of an earlier attempt.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field

from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.types import AbortAction, DecodeFinished
from tandem.engine.request import InvalidRequestError, Request
from tandem.engine.runner import ModelRunner
from tandem.kvtransfer.transport import KVTransport
from tandem.kvtransfer.types import KVTransferAborted
from tandem.prefill.job import PrefillJob


class PrefillDispatcher(ABC):
    """Chooses a prefill rank for a job and sends it there."""

    @abstractmethod
    def choose(self, request: Request, preferred: str | None = None) -> str:
        """The name of the prefill rank to compute ``request``'s KV: ``preferred`` (the router's
        choice) when this rank knows it, else one of its own choosing."""

    @abstractmethod
    def send(self, prefill_rank: str, job: PrefillJob) -> None: ...


@dataclass
class Bill:
    """What one request cost and where its time went (seconds, from its arrival on this rank).

    ``kv_transfer_s`` is the sender's span from its first write to posting the last one;
    ``kv_transfer_exposed_s`` is the wait for the KV beyond the prefill's queue and compute time.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    new_prompt_tokens: int = 0
    output_tokens: int = 0
    kv_bytes: int = 0
    kv_wait_s: float = 0.0
    kv_transfer_s: float = 0.0
    kv_transfer_exposed_s: float = 0.0
    reservation_wait_s: float = 0.0
    prefill_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    ttft_s: float = 0.0
    token_times_s: list[float] = field(default_factory=list)
    decode_s: float = 0.0
    e2e_s: float = 0.0


@dataclass(frozen=True)
class DecodeResult:
    request_id: str
    token_ids: list[int]
    finish_reason: str
    error: str | None
    prefill_rank: str | None
    decode_rank: str
    bill: Bill


@dataclass(frozen=True)
class Routing:
    """Where a request came from and the prefill rank its router chose."""

    prefill_rank: str | None = None
    frontend: str | None = None


@dataclass(frozen=True)
class TokenDelta:
    """New output tokens of one request: indices ``start_index`` onwards, with the wall-clock
    time (Unix seconds) each became known on the decode rank."""

    request_id: str
    start_index: int
    token_ids: tuple[int, ...]
    times_unix_s: tuple[float, ...]


@dataclass
class StreamBatch:
    """What one decode rank pushes to one frontend after a loop iteration."""

    decode_rank: str
    deltas: list[TokenDelta] = field(default_factory=list)
    finished: list[DecodeResult] = field(default_factory=list)


@dataclass
class _Track:
    arrival: float
    routing: Routing = field(default_factory=Routing)
    prefill_rank: str | None = None
    expect_at: float = 0.0
    streamed: int = 0  # output tokens already pushed to the frontend
    bill: Bill = field(default_factory=Bill)


class DecodeWorker:
    def __init__(
        self,
        rank: str,
        incarnation: int,
        scheduler: DecodeScheduler,
        runner: ModelRunner,
        transport: KVTransport,
        dispatcher: PrefillDispatcher,
        kv_timeout_s: float = 30.0,
    ) -> None:
        self.rank, self.incarnation = rank, incarnation
        self.scheduler = scheduler
        self.runner = runner
        self.transport = transport
        self.dispatcher = dispatcher
        self.kv_timeout_s = kv_timeout_s
        self._tracks: dict[str, _Track] = {}
        self._attempts: dict[str, int] = {}  # request id -> attempt of its current transfer
        self.results: list[DecodeResult] = []
        self._pushes: dict[str, StreamBatch] = {}

    def submit(self, requests: list[Request], routing: Mapping[str, Routing] | None = None) -> None:
        now = time.monotonic()
        for request in requests:
            track = _Track(now, (routing or {}).get(request.request_id, Routing()))
            try:
                self.scheduler.add_request(request)
            except InvalidRequestError as error:  # e.g. its id is in use here: it alone fails
                result = DecodeResult(
                    request.request_id, [], "error", str(error), None, self.rank, track.bill
                )
                self._report(track, result)
                continue
            self._tracks[request.request_id] = track

    def abort(self, request_id: str) -> None:
        result = self.scheduler.abort(request_id)
        if result.action is AbortAction.CANCEL_TRANSFER:
            self.transport.abort_receive(f"{request_id}#{self._attempts[request_id]}")
        elif result.finished is not None:
            self._finish(result.finished)

    def abort_frontend(self, frontend: str) -> int:
        """Abort every request of a frontend that is gone; how many."""
        ids = [rid for rid, track in self._tracks.items() if track.routing.frontend == frontend]
        for request_id in ids:
            self.abort(request_id)
        return len(ids)

    def has_work(self) -> bool:
        """A batch to decode this step; requests only waiting for their KV need no step."""
        return self.scheduler.num_running > 0

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def take_results(self) -> list[DecodeResult]:
        out, self.results = self.results, []
        return out

    def take_pushes(self) -> dict[str, StreamBatch]:
        """Token deltas and results of streamed requests since the last call, by frontend."""
        out, self._pushes = self._pushes, {}
        return out

    def fail_all(self, reason: str) -> list[DecodeResult]:
        """End every request this rank holds with ``reason`` (its group is going down)."""
        for request_id, track in list(self._tracks.items()):
            request = self.scheduler.get(request_id)
            tokens = list(request.output_token_ids) if request else []
            prefill_rank = track.prefill_rank
            self._report(
                track, DecodeResult(request_id, tokens, "error", reason, prefill_rank, self.rank, track.bill)
            )
        self._tracks.clear()
        return self.take_results()

    def _report(self, track: _Track, result: DecodeResult) -> None:
        frontend = track.routing.frontend
        if frontend is None:
            self.results.append(result)
        else:
            self._batch(frontend).finished.append(result)

    def _batch(self, frontend: str) -> StreamBatch:
        batch = self._pushes.get(frontend)
        if batch is None:
            batch = self._pushes[frontend] = StreamBatch(self.rank)
        return batch

    def _stream_new_tokens(self, request: Request, track: _Track, now_unix_s: float) -> None:
        frontend = track.routing.frontend
        outputs = request.output_token_ids
        if frontend is None or len(outputs) <= track.streamed:
            return
        new = tuple(outputs[track.streamed :])
        delta = TokenDelta(request.request_id, track.streamed, new, (now_unix_s,) * len(new))
        self._batch(frontend).deltas.append(delta)
        track.streamed = len(outputs)

    def tick(self) -> None:
        now = time.monotonic()
        events = self.transport.poll()
        for got in events.received:
            request_id, attempt = _split(got.notification.request_id)
            track = self._tracks.get(request_id)
            if track is not None:
                bill, timings = track.bill, got.notification.timings
                bill.kv_bytes += got.stats.bytes
                bill.kv_wait_s = now - track.expect_at
                bill.prefill_queue_s = timings.get("prefill_queue_s", 0.0)
                bill.prefill_compute_s = timings.get("prefill_compute_s", 0.0)
                bill.kv_transfer_s = timings.get("kv_transfer_s", 0.0)
                bill.kv_transfer_exposed_s = max(
                    bill.kv_wait_s - bill.prefill_queue_s - bill.prefill_compute_s, 0.0
                )
                if not bill.token_times_s:
                    bill.ttft_s = now - track.arrival
                    bill.token_times_s.append(bill.ttft_s)
            n = got.notification
            finished = self.scheduler.kv_arrived(request_id, n.first_token, n.cached_tokens, attempt=attempt)
            request = self.scheduler.get(request_id)
            if track is not None and request is not None:
                self._stream_new_tokens(request, track, time.time())
            self._maybe_finish(finished)
        for failure in events.failed:
            if failure.role != "recv":
                continue
            request_id, attempt = _split(failure.request_id)
            retry = not isinstance(failure.error, KVTransferAborted) or "prefill" in failure.error.by
            self._maybe_finish(
                self.scheduler.kv_failed(request_id, str(failure.error), retry, attempt=attempt)
            )
        for request_id in self.scheduler.expired(now):
            self.transport.abort_receive(f"{request_id}#{self._attempts[request_id]}")
        for reservation in self.scheduler.reserve(now):
            request = self.scheduler.get(reservation.request_id)
            assert request is not None
            transfer_id = f"{request.request_id}#{reservation.attempt}"
            self._attempts[request.request_id] = reservation.attempt
            track = self._tracks[request.request_id]
            # the router's choice holds for the first attempt; a retry goes where this rank likes
            preferred = track.routing.prefill_rank if reservation.attempt <= 1 else None
            prefill_rank = self.dispatcher.choose(request, preferred)
            track.prefill_rank, track.expect_at = prefill_rank, time.monotonic()
            if reservation.attempt <= 1:
                track.bill.reservation_wait_s = track.expect_at - track.arrival
            self.transport.expect(transfer_id, prefill_rank, reservation.page_ids, self.kv_timeout_s)
            job = PrefillJob(
                request_id=transfer_id,
                prompt_token_ids=tuple(request.all_token_ids[: reservation.num_prompt_tokens]),
                sampling=request.sampling,
                output_index=len(request.output_token_ids),
                destination=reservation.destination(self.rank, self.incarnation),
                deadline_s=time.time() + self.kv_timeout_s,
            )
            self.dispatcher.send(prefill_rank, job)

    def step(self) -> None:
        plan = self.scheduler.schedule()
        sampled = self.runner.run(plan)
        now, now_unix_s = time.monotonic(), time.time()
        requests = [r for r in (self.scheduler.get(c.request_id) for c in plan.chunks) if r is not None]
        before = [len(r.output_token_ids) for r in requests]
        finished = self.scheduler.update(plan, sampled)
        for request, count in zip(requests, before, strict=True):
            track = self._tracks.get(request.request_id)
            if track is not None and len(request.output_token_ids) > count:  # one timestamp a token
                track.bill.token_times_s.append(now - track.arrival)
                self._stream_new_tokens(request, track, now_unix_s)
        for record in finished:
            self._finish(record)

    def _maybe_finish(self, finished: DecodeFinished | None) -> None:
        if finished is not None:
            self._finish(finished)

    def _finish(self, finished: DecodeFinished) -> None:
        request = finished.request
        track = self._tracks.pop(request.request_id, _Track(time.monotonic()))
        self._attempts.pop(request.request_id, None)
        self._stream_new_tokens(request, track, time.time())
        bill = track.bill
        bill.prompt_tokens = request.num_prompt_tokens
        bill.cached_tokens = request.num_cached_tokens
        bill.new_prompt_tokens = bill.prompt_tokens - bill.cached_tokens
        bill.output_tokens = len(request.output_token_ids)
        bill.e2e_s = time.monotonic() - track.arrival
        bill.decode_s = max(bill.e2e_s - bill.ttft_s, 0.0) if bill.token_times_s else 0.0
        self._report(
            track,
            DecodeResult(
                request.request_id,
                list(request.output_token_ids),
                finished.finish_reason,
                finished.error,
                track.prefill_rank,
                self.rank,
                bill,
            ),
        )


def _split(transfer_id: str) -> tuple[str, int]:
    request_id, _, attempt = transfer_id.rpartition("#")
    return request_id, int(attempt)
