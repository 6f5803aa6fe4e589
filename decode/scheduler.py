"""The decode rank's scheduler: pre-allocation queue, waiting-for-KV set, running batch.

A decode rank owns a request from routing to its end. Its ``Request.status``::

    add_request
        |
        v            reserve                 kv_arrived
    WAITING    ------------------> WAITING_FOR_KV -------------> RUNNING ----> DecodeFinished
    PREEMPTED    FIFO, the head     pages reserved,              one token       (update, abort,
      ^   ^      blocks the rest    deadline (expired)           per step         kv_* failures)
      |   |                              |                          |
      |   +------ front <-- kv_failed(retry) ---+                   |
      +---------- front <-- preempted: no page for the next token, the newest goes

A request in the queue is WAITING until it has outputs, PREEMPTED after; it ends FINISHED_*
(FINISHED_ABORTED for an abort, FINISHED_ERROR for a failure).

Pages: a WAITING_FOR_KV or RUNNING request holds each of its pages alone (refcount 1), but for
a forked one (``fork``: a choice of a request for several, on its parent's prompt), which shares
its parent's prompt pages but the last (refcount 2 and more: freed when the last owner ends); a
queued or preempted one holds none. A WAITING_FOR_KV request's pages are freed only by ``kv_arrived``
(they become its KV) or ``kv_failed`` (the transfer is over: no write can land any more); never
on a deadline or an abort alone, since a write may still be in flight. The caller therefore
answers every id ``expired`` returns and every ``CANCEL_TRANSFER`` with a later ``kv_failed``.

Recompute after preemption: the request's next prefill job covers ``all_token_ids[:-1]``; the
token that prefill samples is ignored and the last output token is the next decode input, so
the outputs continue exactly as if there had been no preemption. A preempted request reserves
again only when its pages fit beside what the running and arriving requests may still grow
into (``_growth_pages``): it waits for them rather than preempt them back, so the batch always
makes progress.

Requests reach RUNNING whenever their KV arrives; each step decodes the first ``max_num_seqs``
of them in arrival order, so reservations can fetch KV ahead while the batch is full. A guided
request whose grammar still compiles sits steps out while RUNNING (``schedule``'s ``held``: the
step never waits for a compile), and ``fail`` ends one whose grammar did not compile.

Speculative decoding: a step may give a request its last token plus drafts, with pages for
every draft's position; the verify step's tokens are appended in order until a stop condition,
and the pages past the next token's, which only rejected drafts wrote, are freed at once. A
running request therefore holds the same pages between steps with drafts as without.

Its parts: each request is one ``DecodeRequest`` record (``decode_request.py``), which the
scheduler owns from ``add_request`` to its ``DecodeFinished``; the wait for KV is ``KVWaits``
(``kv_wait.py``), the running batch and each step's plan ``RunningBatch``
(``running_batch.py``), the invariants ``check_decode_invariants`` (``invariants.py``). The
scheduler is the queue and the moves between them.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Container, Mapping, Sequence

from tandem.decode.decode_request import DecodeRequest
from tandem.decode.invariants import check_decode_invariants
from tandem.decode.kv_wait import KVWaits, check_arrival
from tandem.decode.running_batch import RunningBatch, with_drafts
from tandem.decode.types import (
    AbortAction,
    AbortResult,
    DecodeFinished,
    DecodeSchedulerConfig,
    Reservation,
)
from tandem.engine.admission import admit_new_request
from tandem.engine.page_allocator import PageAccountingError, PageAllocator
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.request import FINISHED_STATUS, Request, RequestStatus
from tandem.engine.scheduler_output import SchedulerOutput
from tandem.wire.logprobs import TokenLogprobs
from tandem.wire.request_params import FinishReason, InvalidRequestError


class DecodeScheduler:
    """One decode rank's scheduler. Pure bookkeeping: it moves ids and counts, the caller moves
    data. It owns each request from ``add_request`` until it returns the request's
    ``DecodeFinished``; every page comes from ``kv_cache`` (prefix caching off: KV comes from
    prefill)."""

    def __init__(self, config: DecodeSchedulerConfig) -> None:
        self.config = config
        self.kv_cache = PrefixCache(PageAllocator(config.num_pages), config.page_size, enabled=False)
        self._entries: dict[str, DecodeRequest] = {}
        self._counter = itertools.count()
        self._queue: deque[DecodeRequest] = deque()
        self._kv = KVWaits(config)  # WAITING_FOR_KV: pages reserved, the KV on its way
        self._running = RunningBatch(config, self.kv_cache)  # RUNNING, in arrival order

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        """Requests in the pre-allocation queue, preempted ones included."""
        return len(self._queue)

    @property
    def num_waiting_for_kv(self) -> int:
        return len(self._kv)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_free_pages(self) -> int:
        return self.kv_cache.num_free_pages

    def has_unfinished_requests(self) -> bool:
        return bool(self._entries)

    def record(self, request_id: str) -> DecodeRequest | None:
        """The record of the unfinished request with this id, or ``None``."""
        return self._entries.get(request_id)

    def records(self) -> list[DecodeRequest]:
        """Every unfinished request's record, in the order they came."""
        return list(self._entries.values())

    def get(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or ``None``."""
        entry = self._entries.get(request_id)
        return entry.request if entry is not None else None

    def status(self, request_id: str) -> RequestStatus | None:
        entry = self._entries.get(request_id)
        return entry.request.status if entry is not None else None

    def attempt(self, request_id: str) -> int | None:
        """The number of the request's latest reservation (``None`` when it has none)."""
        entry = self._entries.get(request_id)
        return entry.attempt if entry is not None and entry.attempt >= 0 else None

    # -- life of a request -----------------------------------------------------------------------

    def add_request(self, request: Request) -> DecodeRequest:
        """Queue a new request and return its record; raise ``InvalidRequestError`` naming the
        field if it can never run. One with outputs already is resumed (moved from a failed
        decode rank): its KV is recomputed as after a preemption, and it decodes on from its
        last output."""
        config = self.config
        if request.request_id in self._entries:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        admit_new_request(request, config.max_model_len, config.page_size, config.num_pages, resumed=True)
        entry = DecodeRequest(request, next(self._counter))
        self._entries[request.request_id] = entry
        self._queue.append(entry)
        return entry

    def fork(self, request: Request, parent_id: str) -> list[tuple[int, int]] | None:
        """Start ``request`` on the prompt KV of ``parent_id``, a running request with the same
        prompt: it shares the parent's pages before the one holding the prompt's last position
        and gets a copy of that one (copy on write: it recomputes that position to draw its
        first token, and both write their outputs after it). Returns the ``(parent page, own
        page)`` copies for the caller to make before the next step, or ``None`` (nothing
        changed) when it cannot fork: the parent is not running here, its prompt differs, the
        request has outputs already, or no page is free. Such a request is added as usual."""
        parent = self._entries.get(parent_id)
        if (
            parent is None
            or parent.request.status is not RequestStatus.RUNNING
            or parent.forked
            or list(parent.request.prompt_token_ids) != list(request.prompt_token_ids)
            or request.output_token_ids
            or request.request_id in self._entries
        ):
            return None
        config = self.config
        admit_new_request(request, config.max_model_len, config.page_size, config.num_pages, resumed=True)
        last = (request.num_prompt_tokens - 1) // config.page_size  # the page of the last position
        own = self.kv_cache.allocate(1)
        if own is None:
            return None
        shared = parent.request.page_ids[:last]
        self.kv_cache.share(shared)
        request.page_ids = [*shared, *own]
        request.num_computed_tokens = request.num_prompt_tokens - 1
        entry = DecodeRequest(request, next(self._counter), forked=True)
        self._entries[request.request_id] = entry
        self._running.add(entry)
        return [(parent.request.page_ids[last], own[0])]

    def reserve(self, now: float) -> list[Reservation]:
        """Reserve pages for queued requests, in order, while pages last and fewer than
        ``max_reservations_in_flight`` wait for KV. A head that does not fit blocks the rest."""
        config = self.config
        reservations: list[Reservation] = []
        while self._queue and len(self._kv) < config.max_reservations_in_flight:
            entry = self._queue[0]
            request = entry.request
            num_tokens = request.num_tokens - 1 if request.output_token_ids else request.num_prompt_tokens
            num_pages = math.ceil(num_tokens / config.page_size)
            if request.num_preemptions and num_pages > self.kv_cache.num_free_pages - self._growth_pages():
                break  # it waits for the batch to finish rather than take the pages it grows into
            page_ids = self.kv_cache.allocate(num_pages)
            if page_ids is None:
                if not len(self._kv) and not self._running:
                    raise PageAccountingError(
                        f"request {request.request_id} cannot reserve pages though no request holds any"
                    )
                break
            self._queue.popleft()
            reservations.append(self._kv.reserve(entry, page_ids, num_tokens, now))
        return reservations

    def _growth_pages(self) -> int:
        """The pages the running and arriving requests may still take, to their ``max_tokens``
        (or their context): a preempted request reserves only beside them, so it never preempts
        one of them in turn. Without this, two requests that do not fit together preempt each
        other forever, each re-prefilled before it makes a token."""
        size, total = self.config.page_size, 0
        for entry in (*self._running, *self._kv.records()):
            request = entry.request
            end = request.num_prompt_tokens + request.sampling.max_tokens
            if request.max_model_len is not None:
                end = min(end, request.max_model_len)
            total += max(0, math.ceil(end / size) - len(request.page_ids))
        return total

    def kv_arrived(
        self,
        request_id: str,
        first_token: int,
        cached_tokens: int,
        *,
        attempt: int | None = None,
        logprobs: TokenLogprobs | None = None,
        prompt_logprobs: Sequence[TokenLogprobs | None] = (),
    ) -> DecodeFinished | None:
        """The KV of a WAITING_FOR_KV request landed: it joins the running batch with
        ``first_token`` as output 0 (a recomputed request keeps its outputs instead), and its
        ``logprobs`` and its prompt's where the prefill rank computed them. Returns the
        record when that finishes it at once, or when it was aborted meanwhile. Unknown ids,
        other phases and other attempts are late arrivals: ignored, ``None``."""
        entry = self._kv.current(request_id, attempt)
        if entry is None:
            return None
        if entry.aborting:
            self._kv.pop(request_id)
            return self._finish(entry, FinishReason.ABORT)
        request = entry.request
        check_arrival(entry, first_token, cached_tokens, prompt_logprobs)
        self._kv.pop(request_id)
        request.num_computed_tokens = entry.num_reserved_tokens
        self._running.add(entry)
        if prompt_logprobs and not request.prompt_logprobs:
            request.prompt_logprobs = list(prompt_logprobs)
        if request.output_token_ids:  # recomputed after preemption: the sampled token is ignored
            return None
        request.num_cached_tokens = cached_tokens
        request.append_output(first_token)
        if logprobs is not None:
            request.record_output_logprobs(1, [logprobs])
        if request.is_finished:
            self._running.remove(entry)
            return self._finish(entry, request.finish_reason or FinishReason.LENGTH)
        return None

    def kv_failed(
        self, request_id: str, reason: str, retry: bool, *, attempt: int | None = None
    ) -> DecodeFinished | None:
        """The transfer of a WAITING_FOR_KV request ended without data; its pages are freed.

        An aborted request finishes as "abort". With ``retry`` and retries left, the request
        goes back to the front of the queue (the caller picks another prefill rank when it is
        reserved again) and ``None`` is returned; otherwise it finishes as "error". Unknown ids,
        other phases and other attempts are ignored (``None``)."""
        entry = self._kv.current(request_id, attempt)
        if entry is None:
            return None
        self._kv.pop(request_id)
        if entry.aborting:
            return self._finish(entry, FinishReason.ABORT)
        if retry and entry.kv_retries < self.config.max_kv_retries:
            entry.kv_retries += 1
            self._requeue_front(entry)
            return None
        error = f"{reason} (gave up after {entry.kv_retries} retries)" if retry else reason
        return self._finish(entry, FinishReason.ERROR, error)

    def expired(self, now: float) -> list[str]:
        """Ids WAITING_FOR_KV past their deadline, each reported once per reservation (aborted
        ones are already being cancelled). Their pages stay reserved: abort the transfer and call
        ``kv_failed`` when the transport reports the abort complete."""
        return self._kv.expired(now)

    def abort(self, request_id: str) -> AbortResult:
        """Abort a request. Queued, preempted and running ones finish now (DONE, with the record);
        one waiting for KV is marked and CANCEL_TRANSFER returned: the caller aborts the transfer
        and the later ``kv_failed`` (or ``kv_arrived``) finishes it as "abort"."""
        entry = self._entries.get(request_id)
        if entry is None:
            return AbortResult(AbortAction.UNKNOWN)
        if entry.request.status is RequestStatus.WAITING_FOR_KV:
            entry.aborting = True
            return AbortResult(AbortAction.CANCEL_TRANSFER)
        if entry.request.status is RequestStatus.RUNNING:
            self._running.remove(entry)
        else:
            self._queue.remove(entry)
        return AbortResult(AbortAction.DONE, self._finish(entry, FinishReason.ABORT))

    def fail(self, request_id: str, error: str) -> DecodeFinished | None:
        """End a RUNNING request with ``error`` (e.g. its grammar did not compile here); its
        pages are freed. Other phases and unknown ids: ``None``, nothing changed."""
        entry = self._entries.get(request_id)
        if entry is None or entry.request.status is not RequestStatus.RUNNING:
            return None
        self._running.remove(entry)
        return self._finish(entry, FinishReason.ERROR, error)

    # -- decode steps ----------------------------------------------------------------------------

    def running_requests(self) -> list[Request]:
        """The requests the next ``schedule`` decodes, in order (the first ``max_num_seqs``)."""
        return self._running.requests()

    def draft_limit(self, request: Request, k: int) -> int:
        """How many of ``k`` drafts a verify step of ``request`` can use (``RunningBatch``)."""
        return self._running.draft_limit(request, k)

    def schedule(
        self, draft_room: Mapping[str, int] | None = None, held: Container[str] = frozenset()
    ) -> SchedulerOutput:
        """Plan one decode step over the running batch (``RunningBatch.plan``): a request whose
        next token finds no free page preempts the newest running request, which goes back to
        the front of the queue to be recomputed."""
        return self._running.plan(draft_room or {}, held, self._preempt)

    def with_drafts(self, output: SchedulerOutput, drafts: Mapping[str, Sequence[int]]) -> SchedulerOutput:
        """``output`` with each chunk's drafts after its token (at most its ``draft_room``)."""
        return with_drafts(output, drafts)

    def update(
        self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]
    ) -> list[DecodeFinished]:
        """Apply a step's tokens (``RunningBatch.apply``); finished requests' pages are freed and
        their records returned. Chunks of requests aborted since ``schedule`` are skipped."""
        ended = self._running.apply(output, sampled, self._entries)
        return [self._finish(entry, reason) for entry, reason in ended]

    # -- invariants ------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise ``PageAccountingError`` unless requests and the KV pool agree (O(pages + requests))."""
        check_decode_invariants(
            self.config,
            self.kv_cache,
            self._entries,
            list(self._queue),
            self._kv.records(),
            list(self._running),
        )

    # -- transitions -----------------------------------------------------------------------------

    def _release_pages(self, entry: DecodeRequest) -> None:
        request = entry.request
        self.kv_cache.free(request.page_ids)
        request.page_ids = []

    def _requeue_front(self, entry: DecodeRequest) -> None:
        """Back to the head of the queue without pages: it is next to be reserved."""
        self._release_pages(entry)
        request = entry.request
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED if request.output_token_ids else RequestStatus.WAITING
        self._queue.appendleft(entry)

    def _preempt(self, entry: DecodeRequest) -> None:
        entry.num_drafts, entry.forked = 0, False  # a forked one is prefilled as any other then
        entry.request.num_preemptions += 1
        self._requeue_front(entry)

    def _finish(self, entry: DecodeRequest, reason: FinishReason, error: str | None = None) -> DecodeFinished:
        """Free the pages and forget the request; the caller has taken it out of its container."""
        request = entry.request
        pages, computed = tuple(request.page_ids), request.num_computed_tokens
        self._release_pages(entry)
        request.status = FINISHED_STATUS[reason]
        del self._entries[request.request_id]
        return DecodeFinished(request, reason, error, entry.kv_retries, pages, computed, entry)
