"""The prefill rank's scheduler: token budget, chunked prefill, prefix reuse, pages held for transfer.

Each step, ``schedule`` plans one batch under ``max_num_batched_tokens`` and returns the same
``SchedulerOutput`` the colocated engine uses, so ``ModelRunner`` runs it unchanged::

    1. queued jobs whose deadline passed are dropped (``take_expired`` reports them)
    2. the job mid-prefill, if any, gets its next chunk
    3. queued jobs in arrival order: match the prompt against the prefix cache, take pages
       for the first chunk. A job whose blocks the store is being asked for is passed over
       until the answer (or the store's deadline) comes; the loop never waits on the store
    A chunk is as long as the budget (and ``prefill_chunk_tokens``), the prompt and the pages left
    allow; only the chunk that completes a prompt samples. A chunk that does not complete its prompt
    ends the plan.

Job lifecycle and page ownership::

    add_job -> WAITING --schedule--> RUNNING --update (last chunk)--> SENDING_KV --transfer_over--> gone
                 no pages            holds its pages                    still holds them: the
                                                                        transport reads them

Why no preemption and no deadlock: a chunk cut short by the budget or by the pages ends the
plan, so at most one job is ever mid-prefill; every other page is held by a transferring job
(released when its transfer is reported over, and every transfer has a deadline), or is free
or evictable. ``add_job`` rejects a prompt that needs more pages than the pool has, so the job
mid-prefill always completes once transfers finish. While it waits, nothing queued starts.

This module moves ids and counts only; it never imports torch.
"""

from __future__ import annotations

import enum
import math
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

from tandem.engine.config_checks import check_context, check_positive_ints
from tandem.engine.page_allocator import PageAccountingError, PageAllocator
from tandem.engine.prefix_cache import LowerTiers, PendingFetch, PrefixCache, PrefixMatch
from tandem.engine.request import RequestStatus
from tandem.engine.scheduler_output import ScheduledChunk, SchedulerOutput, StaleSchedulerOutputError
from tandem.prefill.invariants import check_prefill_invariants
from tandem.prefill.job_state import JobState
from tandem.wire.kv_events import KVEvent
from tandem.wire.prefill_job import PrefillDone, PrefillExpired, PrefillJob, PrefillTimings
from tandem.wire.request_params import InvalidRequestError

# Token ids are hashed as signed 64-bit integers; without a vocabulary that is the bound.
_MAX_TOKEN_ID = 2**63 - 1


@dataclass(frozen=True, kw_only=True)
class PrefillSchedulerConfig:
    """One prefill rank's limits. ``max_num_batched_tokens`` is the token budget per step and
    ``max_num_seqs`` the most jobs in one step's batch. With ``vocab_size`` set, token ids of
    incoming jobs are checked against it."""

    num_pages: int
    page_size: int = 64
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int
    enable_prefix_caching: bool = True
    vocab_size: int | None = None
    prefill_chunk_tokens: int | None = None  # the most prompt tokens one job computes in a step

    def __post_init__(self) -> None:
        check_positive_ints(
            self, "num_pages", "page_size", "max_num_seqs", "max_num_batched_tokens", "max_model_len"
        )
        if self.prefill_chunk_tokens is not None:
            check_positive_ints(self, "prefill_chunk_tokens")
        check_context(self.max_model_len)
        if not isinstance(self.enable_prefix_caching, bool):
            raise ValueError(f"enable_prefix_caching must be a bool, got {self.enable_prefix_caching!r}")
        if self.vocab_size is not None:
            check_positive_ints(self, "vocab_size")


class AbortAction(enum.Enum):
    """What ``abort`` did, and what the caller still owes."""

    UNKNOWN = "unknown"  # no such job here (finished, expired or never added)
    DEQUEUED = "dequeued"  # was queued: gone, it never held pages
    STOPPED = "stopped"  # was computing: gone, its pages freed
    ABORT_TRANSFER = "abort_transfer"  # transferring: abort the transfer, then call transfer_over


class PrefillStateError(RuntimeError):
    """A call that does not fit the job's state, e.g. ``transfer_over`` of a job still computing."""

    def __init__(self, request_id: str, status: RequestStatus, wanted: str) -> None:
        super().__init__(f"prefill job {request_id} is {status.name}; {wanted}")
        self.request_id = request_id
        self.status = status


class PrefillScheduler:
    """Owns its jobs from ``add_job`` until ``transfer_over``, ``abort`` or expiry, and asks
    ``kv_cache`` (its ``PrefixCache``) for every page. The caller drives it::

        plan = scheduler.schedule(now)
        done = scheduler.update(plan, runner.run(plan), now)   # start a transfer for each
        ...                                                    # transport reports one over:
        scheduler.transfer_over(request_id)
    """

    def __init__(self, config: PrefillSchedulerConfig, tiers: LowerTiers | None = None) -> None:
        """``tiers``: the host tier and store below the device pages (``engine/kv_tiers.py``);
        the caller executes the copies they record after ``schedule`` and after ``update``."""
        self.config = config
        self.kv_cache = PrefixCache(
            PageAllocator(config.num_pages),
            config.page_size,
            enabled=config.enable_prefix_caching,
            tiers=tiers,
        )
        # Insertion order is arrival order (admission is FIFO, so computing is in arrival order too).
        self._queued: OrderedDict[str, JobState] = OrderedDict()
        self._computing: dict[str, JobState] = {}
        self._transferring: dict[str, JobState] = {}
        self._expired: list[PrefillExpired] = []
        # queued jobs the last plan passed over, with the store fetch each waits on
        self._held_for_store: dict[str, PendingFetch] = {}

    # -- state ---------------------------------------------------------------------------------

    @property
    def num_queued(self) -> int:
        return len(self._queued)

    @property
    def num_computing(self) -> int:
        return len(self._computing)

    @property
    def num_pending_tokens(self) -> int:
        """Prompt tokens still to compute: a queued job's whole prompt (its cached prefix is
        found when it is admitted), a computing job's rest. Frontends share it as load. Read off
        the loop thread (``RankLoop.stats``): it sums over copies, which the loop may not change
        under it."""
        queued = sum(len(s.job.prompt_token_ids) for s in tuple(self._queued.values()))
        return queued + sum(
            len(s.job.prompt_token_ids) - s.num_computed_tokens for s in tuple(self._computing.values())
        )

    @property
    def num_transferring(self) -> int:
        return len(self._transferring)

    @property
    def num_free_pages(self) -> int:
        """Pages a chunk could take now: free plus evictable."""
        return self.kv_cache.num_free_pages

    @property
    def num_queried_tokens(self) -> int:
        return self.kv_cache.num_queried_tokens

    @property
    def num_hit_tokens(self) -> int:
        return self.kv_cache.num_hit_tokens

    def has_work(self) -> bool:
        """Whether anything is queued or computing; a plan may still be empty while pages are held
        by transfers, so the caller keeps polling its transport. Queued jobs that all wait on
        the store are no work until it answers (the loop idles instead of stepping empty)."""
        held = self._held_for_store
        return bool(self._computing) or any(
            request_id not in held or held[request_id].settled() for request_id in self._queued
        )

    def _store_fetch(self, state: JobState) -> PendingFetch | None:
        """The store fetch ``state``'s prefix lookup waits on (``None``: it may run now)."""
        if _wants_prompt_logprobs(state.job):
            return None
        return self.kv_cache.prefetch(state.job.prompt_token_ids, state.job.cache_salt)

    def status(self, request_id: str) -> RequestStatus | None:
        state = self._find(request_id)
        return None if state is None else state.status

    def take_events(self) -> list[KVEvent]:
        """KV events (``BlockStored``/``BlockRemoved``) since the last call, for the router."""
        return self.kv_cache.take_events()

    def take_expired(self) -> list[PrefillExpired]:
        """Jobs dropped since the last call because their deadline passed while queued."""
        expired, self._expired = self._expired, []
        return expired

    # -- lifecycle -----------------------------------------------------------------------------

    def add_job(self, job: PrefillJob, now: float) -> None:
        """Queue ``job``; raise ``InvalidRequestError`` naming the field if it can never run."""
        error = self.refusal(job)
        if error is not None:
            raise error
        self._queued[job.request_id] = JobState(job=job, arrival_s=now)

    def refusal(self, job: PrefillJob) -> InvalidRequestError | None:
        """Why ``add_job`` would refuse ``job`` now (it can never run here, or its id is in
        use), naming the field; ``None`` when it would take it."""
        config = self.config
        vocab_size = config.vocab_size if config.vocab_size is not None else _MAX_TOKEN_ID
        try:
            job.validate(vocab_size, config.max_model_len, config.page_size)
        except InvalidRequestError as error:
            return error
        if self._find(job.request_id) is not None:
            return InvalidRequestError("request_id", f"{job.request_id!r} is already in use on this rank")
        num_pages = job.num_pages(config.page_size)
        if num_pages > config.num_pages:
            return InvalidRequestError(
                "prompt_token_ids",
                f"{job.num_prompt_tokens} tokens need {num_pages} pages but the pool has only "
                f"{config.num_pages}; send it to a rank with a larger pool or shorten it",
            )
        return None

    def abort(self, request_id: str) -> AbortAction:
        """Stop a job. A computing job's pages are freed at once: the transfer only ever reads
        them, so a new owner may reuse them, but if the actor already began writes for this job
        it must abort them so the decode side's pages are not written after it frees them. A
        transferring job keeps its pages until the caller aborts the transfer and reports it
        with ``transfer_over``. Between ``schedule`` and ``update`` an abort is safe: the chunk in
        flight writes only pages nothing else can take before the next ``schedule``."""
        if self._queued.pop(request_id, None) is not None:
            return AbortAction.DEQUEUED
        state = self._computing.pop(request_id, None)
        if state is not None:
            self.kv_cache.free(state.page_ids)
            state.page_ids = []
            return AbortAction.STOPPED
        if request_id in self._transferring:
            return AbortAction.ABORT_TRANSFER
        return AbortAction.UNKNOWN

    def transfer_over(self, request_id: str) -> bool:
        """Release a transferring job's pages once the transport reports its send completed or
        failed. Full pages stay cached as evictable; the partial last page is freed. Returns
        False for an unknown id (e.g. a duplicate report)."""
        state = self._transferring.pop(request_id, None)
        if state is None:
            other = self._find(request_id)
            if other is not None:
                raise PrefillStateError(request_id, other.status, "only a transferring job can be over")
            return False
        self.kv_cache.free(state.page_ids)
        state.page_ids = []
        return True

    # -- stepping ------------------------------------------------------------------------------

    def schedule(self, now: float) -> SchedulerOutput:
        """Plan one step (see the module docstring). Call ``update`` with it before the next."""
        for state in self._computing.values():
            if state.scheduled_end != state.num_computed_tokens:
                raise StaleSchedulerOutputError(
                    f"{state.job.request_id} has a chunk in flight; update with the last plan first"
                )
        self._drop_expired(now)
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        completes = True
        for state in list(self._computing.values()):
            chunk = self._next_chunk(state, budget)
            if chunk is None:
                completes = False
                break
            chunks.append(chunk)
            budget -= len(chunk.token_ids)
            completes = chunk.sample
            if not completes:
                break
        self._held_for_store = {}
        for state in list(self._queued.values()):
            if not (completes and budget > 0 and len(chunks) < self.config.max_num_seqs):
                break
            pending = self._store_fetch(state)
            if pending is not None:  # its blocks are being fetched: the others go on
                self._held_for_store[state.job.request_id] = pending
                continue
            chunk = self._admit(state, budget, now)
            if chunk is None:
                break
            chunks.append(chunk)
            budget -= len(chunk.token_ids)
            completes = chunk.sample
        return SchedulerOutput(
            chunks=tuple(chunks),
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_request_ids=(),
        )

    def update(self, output: SchedulerOutput, sampled: Mapping[str, int], now: float) -> list[PrefillDone]:
        """Apply a step: advance computed tokens, cache newly full pages, and move each job whose
        last chunk ran to ``SENDING_KV``. ``sampled`` maps every sampling chunk's id to its token;
        chunks of jobs aborted since ``schedule`` are skipped."""
        size = self.config.page_size
        done: list[PrefillDone] = []
        for chunk in output.chunks:
            state = self._computing.get(chunk.request_id)
            if state is None:
                continue
            end = chunk.start_position + len(chunk.token_ids)
            if chunk.start_position != state.num_computed_tokens or end != state.scheduled_end:
                raise StaleSchedulerOutputError(
                    f"chunk [{chunk.start_position}, {end}) of {chunk.request_id} is not the one planned "
                    f"[{state.num_computed_tokens}, {state.scheduled_end}); apply each plan once, in order"
                )
            prompt = state.job.prompt_token_ids
            state.num_computed_tokens = end
            if end // size > chunk.start_position // size:
                self.kv_cache.cache_full_pages(
                    prompt,
                    state.page_ids,
                    end,
                    num_cached_pages_hint=chunk.start_position // size,
                    cache_salt=state.job.cache_salt,
                )
            if not chunk.sample:
                continue
            if chunk.request_id not in sampled:
                raise StaleSchedulerOutputError(f"no sampled token for {chunk.request_id}, which samples")
            del self._computing[chunk.request_id]
            state.status = RequestStatus.SENDING_KV
            self._transferring[chunk.request_id] = state
            timings = PrefillTimings(queue_s=state.start_s - state.arrival_s, compute_s=now - state.start_s)
            done.append(
                PrefillDone(
                    request_id=chunk.request_id,
                    first_token=sampled[chunk.request_id],
                    cached_tokens=state.num_cached_tokens,
                    src_page_ids=tuple(state.page_ids),
                    destination=state.job.destination,
                    timings=timings,
                    cached_host_tokens=state.num_host_tokens,
                    cached_store_tokens=state.num_store_tokens,
                )
            )
        return done

    def _drop_expired(self, now: float) -> None:
        for request_id, state in list(self._queued.items()):
            if now >= state.job.deadline_s:
                del self._queued[request_id]
                job = state.job
                self._expired.append(
                    PrefillExpired(request_id, job.destination, job.deadline_s, queue_s=now - state.arrival_s)
                )

    def _admit(self, state: JobState, budget: int, now: float) -> ScheduledChunk | None:
        """Match the cached prefix and plan the first chunk; all or nothing."""
        prompt = state.job.prompt_token_ids
        # a prompt's logprobs need every position's logits, which its cached pages do not keep
        uncached = _wants_prompt_logprobs(state.job)
        found = PrefixMatch() if uncached else self.kv_cache.match(prompt, state.job.cache_salt)
        page_ids, num_cached = found.page_ids, found.num_tokens
        state.page_ids, state.num_computed_tokens, state.scheduled_end = page_ids, num_cached, num_cached
        chunk = self._next_chunk(state, budget)
        if chunk is None:
            if not uncached:
                self.kv_cache.undo_match(page_ids, len(prompt))
            state.page_ids, state.num_computed_tokens, state.scheduled_end = [], 0, 0
            return None
        del self._queued[state.job.request_id]
        state.status, state.num_cached_tokens, state.start_s = RequestStatus.RUNNING, num_cached, now
        state.num_host_tokens, state.num_store_tokens = found.host_tokens, found.store_tokens
        self._computing[state.job.request_id] = state
        return chunk

    def _next_chunk(self, state: JobState, budget: int) -> ScheduledChunk | None:
        """Take pages for the longest chunk the budget, the prompt and the pool allow; ``None``
        (nothing taken) when not one more token fits."""
        size, job = self.config.page_size, state.job
        start = state.num_computed_tokens
        reachable = (len(state.page_ids) + self.kv_cache.num_free_pages) * size
        chunk = (
            budget
            if self.config.prefill_chunk_tokens is None
            else min(budget, self.config.prefill_chunk_tokens)
        )
        end = min(job.num_prompt_tokens, start + chunk, reachable)
        if end <= start:
            return None
        new_pages = self.kv_cache.allocate(math.ceil(end / size) - len(state.page_ids))
        if new_pages is None:
            raise PageAccountingError(f"pages counted free for {job.request_id} could not be allocated")
        state.page_ids.extend(new_pages)
        state.scheduled_end = end
        return ScheduledChunk(
            request_id=job.request_id,
            token_ids=job.prompt_token_ids[start:end],
            start_position=start,
            page_ids=tuple(state.page_ids),
            sample=end == job.num_prompt_tokens,
            sampling=job.sampling,
            output_index=job.output_index,
            next_token_id=job.prompt_token_ids[end] if end < job.num_prompt_tokens else None,
            history=_history(job) if end == job.num_prompt_tokens and job.sampling.needs_history else None,
            prompt_logprob_targets=job.prompt_token_ids[start + 1 : end + 1]
            if _wants_prompt_logprobs(job)
            else (),
        )

    def _find(self, request_id: str) -> JobState | None:
        return (
            self._queued.get(request_id)
            or self._computing.get(request_id)
            or self._transferring.get(request_id)
        )

    # -- invariants ----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise ``PageAccountingError`` unless jobs and the KV pool agree (O(all tokens): for tests)."""
        check_prefill_invariants(self.kv_cache, self._queued, self._computing, self._transferring)


def _history(job: PrefillJob) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A job's prompt and outputs, for its penalties. A first prefill (``output_index`` 0) has no
    outputs; a re-prefill's tokens end with the request's outputs so far (all but the last, which
    is the decode rank's next input), and the token it samples is one the decode rank ignores,
    so the split only has to be deterministic there."""
    split = len(job.prompt_token_ids) - job.output_index
    return tuple(job.prompt_token_ids[:split]), tuple(job.prompt_token_ids[split:])


def _wants_prompt_logprobs(job: PrefillJob) -> bool:
    """A first prefill that returns its prompt's logprobs (a re-prefill's prompt has them already)."""
    return job.sampling.prompt_logprobs is not None and job.output_index == 0
