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
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
from collections import deque
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass

from tandem.decode.types import (
    AbortAction,
    AbortResult,
    DecodeFinished,
    DecodeSchedulerConfig,
    KVNotificationError,
    Reservation,
)
from tandem.engine.admission import admit_new_request
from tandem.engine.page_allocator import PageAccountingError, PageAllocator
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.request import FINISHED_STATUS, Request, RequestStatus
from tandem.engine.scheduler_output import ScheduledChunk, SchedulerOutput, StaleSchedulerOutputError
from tandem.wire.logprobs import TokenLogprobs
from tandem.wire.request_params import FinishReason, InvalidRequestError


@dataclass(eq=False)
class _Entry:
    """Decode-side transfer bookkeeping of one unfinished request (compared by identity); where
    it is lives in ``request.status``."""

    request: Request
    arrival: int
    attempt: int = -1  # number of the latest reservation
    num_reserved_tokens: int = 0  # tokens the current reservation's prefill writes
    deadline_s: float = math.inf
    kv_retries: int = 0
    aborting: bool = False  # aborted while WAITING_FOR_KV: finishes as "abort" when the transfer ends
    expiry_reported: bool = False
    num_drafts: int = 0  # draft room of the step scheduled and not yet updated: its pages are held
    forked: bool = False  # running on its parent's prompt pages, its first token not yet drawn


class DecodeScheduler:
    """One decode rank's scheduler. Pure bookkeeping: it moves ids and counts, the caller moves
    data. It owns each request from ``add_request`` until it returns the request's
    ``DecodeFinished``; every page comes from ``kv_cache`` (prefix caching off: KV comes from
    prefill)."""

    def __init__(self, config: DecodeSchedulerConfig) -> None:
        self.config = config
        self.kv_cache = PrefixCache(PageAllocator(config.num_pages), config.page_size, enabled=False)
        self._entries: dict[str, _Entry] = {}
        self._counter = itertools.count()
        self._queue: deque[_Entry] = deque()
        self._waiting_for_kv: dict[str, _Entry] = {}
        self._running: list[_Entry] = []  # sorted by arrival

    # -- queries ---------------------------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        """Requests in the pre-allocation queue, preempted ones included."""
        return len(self._queue)

    @property
    def num_waiting_for_kv(self) -> int:
        return len(self._waiting_for_kv)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_free_pages(self) -> int:
        return self.kv_cache.num_free_pages

    def has_unfinished_requests(self) -> bool:
        return bool(self._entries)

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

    def add_request(self, request: Request) -> None:
        """Queue a new request; raise ``InvalidRequestError`` naming the field if it can never run.
        One with outputs already is resumed (moved from a failed decode rank): its KV is
        recomputed as after a preemption, and it decodes on from its last output."""
        config = self.config
        if request.request_id in self._entries:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        admit_new_request(request, config.max_model_len, config.page_size, config.num_pages, resumed=True)
        entry = _Entry(request, next(self._counter))
        self._entries[request.request_id] = entry
        self._queue.append(entry)

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
        request.status = RequestStatus.RUNNING
        entry = _Entry(request, next(self._counter), forked=True)
        self._entries[request.request_id] = entry
        bisect.insort(self._running, entry, key=lambda e: e.arrival)
        return [(parent.request.page_ids[last], own[0])]

    def reserve(self, now: float) -> list[Reservation]:
        """Reserve pages for queued requests, in order, while pages last and fewer than
        ``max_reservations_in_flight`` wait for KV. A head that does not fit blocks the rest."""
        config = self.config
        reservations: list[Reservation] = []
        while self._queue and len(self._waiting_for_kv) < config.max_reservations_in_flight:
            entry = self._queue[0]
            request = entry.request
            num_tokens = request.num_tokens - 1 if request.output_token_ids else request.num_prompt_tokens
            num_pages = math.ceil(num_tokens / config.page_size)
            if request.num_preemptions and num_pages > self.kv_cache.num_free_pages - self._growth_pages():
                break  # it waits for the batch to finish rather than take the pages it grows into
            page_ids = self.kv_cache.allocate(num_pages)
            if page_ids is None:
                if not self._waiting_for_kv and not self._running:
                    raise PageAccountingError(
                        f"request {request.request_id} cannot reserve pages though no request holds any"
                    )
                break
            self._queue.popleft()
            request.page_ids = page_ids
            request.status = RequestStatus.WAITING_FOR_KV
            entry.attempt += 1
            entry.num_reserved_tokens = num_tokens
            entry.deadline_s = now + config.kv_wait_timeout_s
            entry.expiry_reported = False
            self._waiting_for_kv[request.request_id] = entry
            reservations.append(
                Reservation(request.request_id, tuple(page_ids), num_tokens, entry.deadline_s, entry.attempt)
            )
        return reservations

    def _growth_pages(self) -> int:
        """The pages the running and arriving requests may still take, to their ``max_tokens``
        (or their context): a preempted request reserves only beside them, so it never preempts
        one of them in turn. Without this, two requests that do not fit together preempt each
        other forever, each re-prefilled before it makes a token."""
        size, total = self.config.page_size, 0
        for entry in (*self._running, *self._waiting_for_kv.values()):
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
        entry = self._current_transfer(request_id, attempt)
        if entry is None:
            return None
        if entry.aborting:
            del self._waiting_for_kv[request_id]
            return self._finish(entry, FinishReason.ABORT)
        request = entry.request
        if not isinstance(first_token, int) or isinstance(first_token, bool) or first_token < 0:
            raise KVNotificationError(
                request_id, "first_token", f"must be a token id >= 0, got {first_token!r}"
            )
        if not 0 <= cached_tokens <= entry.num_reserved_tokens:
            raise KVNotificationError(
                request_id, "cached_tokens", f"{cached_tokens} is outside [0, {entry.num_reserved_tokens}]"
            )
        if prompt_logprobs and len(prompt_logprobs) != request.num_prompt_tokens:
            raise KVNotificationError(
                request_id,
                "logprobs.prompt",
                f"has {len(prompt_logprobs)} entries for a {request.num_prompt_tokens}-token prompt",
            )
        del self._waiting_for_kv[request_id]
        request.num_computed_tokens = entry.num_reserved_tokens
        request.status = RequestStatus.RUNNING
        bisect.insort(self._running, entry, key=lambda e: e.arrival)
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
        entry = self._current_transfer(request_id, attempt)
        if entry is None:
            return None
        del self._waiting_for_kv[request_id]
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
        ids = []
        for request_id, entry in self._waiting_for_kv.items():
            if not entry.aborting and not entry.expiry_reported and now >= entry.deadline_s:
                entry.expiry_reported = True
                ids.append(request_id)
        return ids

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
        return [e.request for e in self._running[: self.config.max_num_seqs]]

    def draft_limit(self, request: Request, k: int) -> int:
        """How many of ``k`` drafts a verify step of ``request`` can use: a step gives at most
        one token more than its drafts, and never past ``max_tokens`` or the context."""
        max_len = request.max_model_len or self.config.max_model_len
        left = min(request.sampling.max_tokens - len(request.output_token_ids), max_len - request.num_tokens)
        return max(0, min(k, left - 1))

    def schedule(
        self, draft_room: Mapping[str, int] | None = None, held: Container[str] = frozenset()
    ) -> SchedulerOutput:
        """Plan one decode step: one token for each of the first ``max_num_seqs`` running requests,
        in arrival order. A request whose next token needs a page when none is free preempts the
        newest running request (perhaps itself, never one scheduled earlier in this step).
        ``held``: running requests that sit this step out (their grammar still compiles); they
        keep their pages and take no place in the batch.

        Speculative decoding: each scheduled request then gets pages for up to
        ``draft_room[request_id]`` drafts (cut to ``draft_limit``) from those left free, its
        chunk's ``draft_room``; drafts never preempt a request nor take the page another one's
        next token needs. ``with_drafts`` puts the drafts in."""
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        scheduled: list[_Entry] = []
        index = 0
        while index < len(self._running) and len(scheduled) < self.config.max_num_seqs:
            entry = self._running[index]
            request = entry.request
            if request.request_id in held:
                index += 1
                continue
            new_pages = self._pages_for(request, request.num_tokens)
            while new_pages is None:
                victim = self._running.pop()  # the newest; the scheduled ones sit before ``index``
                self._preempt(victim)
                preempted.append(victim.request.request_id)
                if victim is entry:
                    break
                new_pages = self._pages_for(request, request.num_tokens)
            if new_pages is None:
                break
            request.page_ids.extend(new_pages)
            scheduled.append(entry)
            index += 1
        for entry in scheduled:
            request = entry.request
            entry.num_drafts = self._reserve_drafts(request, (draft_room or {}).get(request.request_id, 0))
            chunks.append(
                ScheduledChunk(
                    request_id=request.request_id,
                    token_ids=(request.all_token_ids[-1],),  # a forked one's: its prompt's last
                    start_position=request.num_tokens - 1,
                    page_ids=tuple(request.page_ids),
                    sample=True,
                    sampling=request.sampling,
                    output_index=len(request.output_token_ids),
                    draft_room=entry.num_drafts,
                    history=(
                        (tuple(request.prompt_token_ids), tuple(request.output_token_ids))
                        if request.sampling.needs_history
                        else None
                    ),
                )
            )
        return SchedulerOutput(
            chunks=tuple(chunks), num_batched_tokens=len(chunks), preempted_request_ids=tuple(preempted)
        )

    def with_drafts(self, output: SchedulerOutput, drafts: Mapping[str, Sequence[int]]) -> SchedulerOutput:
        """``output`` with each chunk's drafts after its token (at most its ``draft_room``)."""
        chunks = []
        for chunk in output.chunks:
            draft = tuple(drafts.get(chunk.request_id, ()))[: chunk.draft_room]
            if draft:
                chunk = dataclasses.replace(
                    chunk, token_ids=(*chunk.token_ids, *draft), draft_token_ids=draft
                )
            chunks.append(chunk)
        return dataclasses.replace(
            output, chunks=tuple(chunks), num_batched_tokens=sum(len(c.token_ids) for c in chunks)
        )

    def _reserve_drafts(self, request: Request, room: int) -> int:
        """Pages for up to ``room`` drafts, cut to ``draft_limit`` and to the free pages; how many."""
        size = self.config.page_size
        free = (len(request.page_ids) + self.kv_cache.num_free_pages) * size - request.num_tokens
        room = max(0, min(self.draft_limit(request, room), free))
        new_pages = self._pages_for(request, request.num_tokens + room)
        assert new_pages is not None  # sized to the free pages above
        request.page_ids.extend(new_pages)
        return room

    def _pages_for(self, request: Request, num_positions: int) -> list[int] | None:
        """The pages to add so that ``request`` covers ``num_positions``, or ``None``."""
        missing = math.ceil(num_positions / self.config.page_size) - len(request.page_ids)
        return self.kv_cache.allocate(missing) if missing > 0 else []

    def update(
        self, output: SchedulerOutput, sampled: Mapping[str, int | Sequence[int]]
    ) -> list[DecodeFinished]:
        """Apply a step's tokens: ``sampled`` maps each chunk's request id to its token, or to
        the tokens its verify step gave. They are appended in order and a stop condition (EOS,
        a stop token, ``max_tokens``, the context) cuts them there; pages that only rejected
        drafts used are freed. Chunks of requests aborted since ``schedule`` are skipped;
        finished requests' pages are freed and their records returned."""
        finished: list[DecodeFinished] = []
        for chunk in output.chunks:
            entry = self._entries.get(chunk.request_id)
            if entry is None or entry.request.status is not RequestStatus.RUNNING:
                continue
            request = entry.request
            if chunk.start_position != request.num_computed_tokens:
                raise StaleSchedulerOutputError(
                    f"chunk for {chunk.request_id} starts at {chunk.start_position} but the request has "
                    f"computed {request.num_computed_tokens} tokens; apply each output once, in order"
                )
            if chunk.request_id not in sampled:
                raise StaleSchedulerOutputError(f"no sampled token for {chunk.request_id}")
            given = sampled[chunk.request_id]
            tokens = (given,) if isinstance(given, int) else tuple(given)
            if not 1 <= len(tokens) <= len(chunk.draft_token_ids) + 1:
                raise StaleSchedulerOutputError(
                    f"{len(tokens)} tokens for {chunk.request_id}, "
                    f"whose step had {len(chunk.draft_token_ids)} drafts"
                )
            entry.num_drafts, entry.forked = 0, False
            for token in tokens:
                request.num_computed_tokens += 1
                request.append_output(token)
                if request.is_finished:
                    break
            if request.is_finished:
                self._running.remove(entry)
                finished.append(self._finish(entry, request.finish_reason or FinishReason.LENGTH))
            elif chunk.draft_room:
                self._trim_pages(request)
        return finished

    def _trim_pages(self, request: Request) -> None:
        """Free the pages past the next token's: only rejected drafts' KV was written there."""
        keep = math.ceil(request.num_tokens / self.config.page_size)
        if len(request.page_ids) > keep:
            self.kv_cache.free(request.page_ids[keep:])
            del request.page_ids[keep:]

    # -- invariants ------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise ``PageAccountingError`` unless requests and the KV pool agree (O(pages + requests))."""
        self.kv_cache.check_integrity()
        size = self.config.page_size
        containers = [
            (RequestStatus.WAITING, list(self._queue)),
            (RequestStatus.WAITING_FOR_KV, list(self._waiting_for_kv.values())),
            (RequestStatus.RUNNING, self._running),
        ]
        held = [e for _, entries in containers for e in entries]
        if len({id(e) for e in held}) != len(held) or {e.request.request_id for e in held} != set(
            self._entries
        ):
            raise PageAccountingError(
                "queue, waiting-for-KV and running do not hold each request exactly once"
            )
        if len(self._waiting_for_kv) > self.config.max_reservations_in_flight:
            raise PageAccountingError(f"{len(self._waiting_for_kv)} requests wait for KV > the limit")
        arrivals = [e.arrival for e in self._running]
        if arrivals != sorted(arrivals):
            raise PageAccountingError("running requests are not in arrival order")
        owners: dict[int, int] = {}
        for where, entries in containers:
            for entry in entries:
                self._check_entry(where, entry, size)
                for page_id in entry.request.page_ids:
                    owners[page_id] = owners.get(page_id, 0) + 1
        for page_id in range(self.kv_cache.num_total_pages):  # a forked request shares its parent's
            count, refcount = owners.get(page_id, 0), self.kv_cache.refcount(page_id)
            if count != refcount:
                raise PageAccountingError(f"page {page_id}: refcount {refcount} but {count} owning requests")

    def _check_entry(self, where: RequestStatus, entry: _Entry, size: int) -> None:
        request = entry.request
        rid, pages, has_outputs = request.request_id, request.page_ids, bool(request.output_token_ids)
        if where is RequestStatus.WAITING:
            queued = RequestStatus.PREEMPTED if has_outputs else RequestStatus.WAITING
            if request.status is not queued:
                raise PageAccountingError(f"queued {rid} is {request.status.name}")
            if pages or request.num_computed_tokens or entry.aborting:
                raise PageAccountingError(f"queued {rid} holds pages or computed tokens, or is aborting")
            return
        if request.status is not where:
            raise PageAccountingError(f"{rid} is {request.status.name} but held as {where.name}")
        if where is RequestStatus.WAITING_FOR_KV:
            expected = request.num_tokens - 1 if has_outputs else request.num_prompt_tokens
            if entry.num_reserved_tokens != expected:
                raise PageAccountingError(f"{rid} waits for KV of {entry.num_reserved_tokens} tokens")
            if len(pages) != math.ceil(expected / size):
                raise PageAccountingError(f"{rid} reserved {len(pages)} pages for {expected} tokens")
            return
        if has_outputs == entry.forked or entry.aborting:  # only a forked one runs before its first
            raise PageAccountingError(
                f"running {rid}: outputs {has_outputs}, forked {entry.forked}, aborting"
            )
        if request.num_computed_tokens != request.num_tokens - 1:
            raise PageAccountingError(f"running {rid} computed {request.num_computed_tokens} tokens")
        if (
            not math.ceil((request.num_tokens - 1) / size)
            <= len(pages)
            <= math.ceil((request.num_tokens + entry.num_drafts) / size)
        ):
            raise PageAccountingError(f"running {rid} has {len(pages)} pages for {request.num_tokens} tokens")

    # -- transitions -----------------------------------------------------------------------------

    def _current_transfer(self, request_id: str, attempt: int | None) -> _Entry | None:
        entry = self._entries.get(request_id)
        if entry is None or entry.request.status is not RequestStatus.WAITING_FOR_KV:
            return None
        if attempt is not None and attempt != entry.attempt:
            return None
        return entry

    def _release_pages(self, entry: _Entry) -> None:
        request = entry.request
        self.kv_cache.free(request.page_ids)
        request.page_ids = []

    def _requeue_front(self, entry: _Entry) -> None:
        """Back to the head of the queue without pages: it is next to be reserved."""
        self._release_pages(entry)
        request = entry.request
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED if request.output_token_ids else RequestStatus.WAITING
        self._queue.appendleft(entry)

    def _preempt(self, entry: _Entry) -> None:
        entry.num_drafts, entry.forked = 0, False  # a forked one is prefilled as any other then
        entry.request.num_preemptions += 1
        self._requeue_front(entry)

    def _finish(self, entry: _Entry, reason: FinishReason, error: str | None = None) -> DecodeFinished:
        """Free the pages and forget the request; the caller has taken it out of its container."""
        request = entry.request
        pages, computed = tuple(request.page_ids), request.num_computed_tokens
        self._release_pages(entry)
        request.status = FINISHED_STATUS[reason]
        del self._entries[request.request_id]
        return DecodeFinished(request, reason, error, entry.kv_retries, pages, computed)
