"""Continuous batching with chunked prefill, prefix reuse and preemption by recompute.

Each step, ``schedule`` decides which tokens' KV to compute and returns one plain
``SchedulerOutput``; the runner computes them and samples; ``update`` applies the sampled
tokens. Policy, per step, under a token budget and a cap on running requests::

    1. running requests, oldest arrival first: the next prefill chunk, or 1 token (decode).
       A request that needs a page when none is left preempts the newest running request
       (perhaps itself): its pages are freed and it goes to the front of the waiting queue
       to be recomputed later.
    2. if nothing was preempted: waiting requests, in order, while pages and budget last.
       Admission looks the request's tokens up in the prefix cache first; a request whose
       pages are not available waits (admission never preempts). One whose blocks the store
       is being asked for is passed over until the answer comes (``PrefixCache.prefetch``).

The scheduler owns its requests' state; everything else only reads it.
"""

from __future__ import annotations

import bisect
import itertools
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.engine.admission import admit_new_request
from tandem.engine.config_checks import check_context, check_positive_ints
from tandem.engine.page_allocator import PageAccountingError, PageAllocator
from tandem.engine.prefix_cache import PendingFetch, PrefixCache, PrefixMatch, block_hashes
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler_output import ScheduledChunk, SchedulerOutput, StaleSchedulerOutputError
from tandem.wire.logprobs import TokenLogprobs
from tandem.wire.request_params import InvalidRequestError

if TYPE_CHECKING:
    pass


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """One rank's scheduling limits. ``max_num_batched_tokens`` is the token budget per step."""

    num_pages: int
    page_size: int = 64
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int
    enable_prefix_caching: bool = True
    prefill_chunk_tokens: int | None = None  # the most tokens one request computes in a step

    def __post_init__(self) -> None:
        check_positive_ints(
            self, "num_pages", "max_model_len", "page_size", "max_num_seqs", "max_num_batched_tokens"
        )
        if self.prefill_chunk_tokens is not None:
            check_positive_ints(self, "prefill_chunk_tokens")
        check_context(self.max_model_len)

    def chunk_budget(self, budget: int) -> int:
        """What one request may compute of ``budget``: all of it, or ``prefill_chunk_tokens``."""
        return budget if self.prefill_chunk_tokens is None else min(budget, self.prefill_chunk_tokens)


class Scheduler:
    """One rank's scheduler. It owns its requests from ``add_request`` until they are returned by
    ``update`` or aborted, and asks ``kv_cache`` (its ``PrefixCache``) for every page."""

    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.kv_cache = PrefixCache(
            PageAllocator(config.num_pages), config.page_size, enabled=config.enable_prefix_caching
        )
        self._requests: dict[str, Request] = {}
        self._arrival: dict[str, int] = {}
        self._counter = itertools.count()
        self._waiting: deque[Request] = deque()
        self._running: list[Request] = []  # sorted by arrival
        # waiting requests the last plan passed over, with the store fetch each waits on
        self._held_for_store: dict[str, PendingFetch] = {}

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    def has_work(self) -> bool:
        """Something to plan: unfinished requests, unless all are waiting on the store's answer."""
        held = self._held_for_store
        return bool(self._running) or any(
            r.request_id not in held or held[r.request_id].settled() for r in self._waiting
        )

    def unfinished_requests(self) -> list[Request]:
        """Every request this scheduler still owns (waiting, running or preempted)."""
        return list(self._requests.values())

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or ``None``."""
        return self._requests.get(request_id)

    def add_request(self, request: Request, resumed: bool = False) -> None:
        """Queue a request; raise ``InvalidRequestError`` naming the field if it can never run.
        A ``resumed`` one comes with outputs (see ``admit_new_request``): its KV is computed for
        prompt and outputs, as after a preemption."""
        config = self.config
        if request.request_id in self._requests:
            raise InvalidRequestError("request_id", f"{request.request_id!r} is already in use")
        admit_new_request(request, config.max_model_len, config.page_size, config.num_pages, resumed)
        self._requests[request.request_id] = request
        self._arrival[request.request_id] = next(self._counter)
        self._waiting.append(request)

    def abort_request(self, request_id: str) -> bool:
        """Finish a waiting, running or preempted request and free its pages; False if unknown."""
        request = self._requests.get(request_id)
        if request is None:
            return False
        if request.status == RequestStatus.RUNNING:
            self._running.remove(request)
        else:
            self._waiting.remove(request)
        self._finish(request, RequestStatus.FINISHED_ABORTED)
        return True

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the module docstring); may preempt running requests."""
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []

        index = 0
        while index < len(self._running) and budget > 0:
            request = self._running[index]
            num_new = min(request.num_tokens - request.num_computed_tokens, self.config.chunk_budget(budget))
            if num_new <= 0:
                raise PageAccountingError(f"running request {request.request_id} has nothing to compute")
            new_pages = self._allocate_for(request, request.num_computed_tokens + num_new)
            while new_pages is None:
                victim = self._running.pop()  # newest; scheduled ones sit before ``index``
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
                new_pages = self._allocate_for(request, request.num_computed_tokens + num_new)
            if new_pages is None:
                break
            request.page_ids.extend(new_pages)
            chunks.append(self._chunk(request, num_new))
            budget -= num_new
            index += 1

        max_num_seqs = self.config.max_num_seqs
        self._held_for_store = {}
        held = 0  # waiting requests passed over: the store is being asked for their blocks
        while (
            not preempted and held < len(self._waiting) and budget > 0 and len(self._running) < max_num_seqs
        ):
            request = self._waiting[held]
            prompt, salt = request.all_token_ids, request.cache_salt
            pending = None if request.needs_prompt_logprobs else self.kv_cache.prefetch(prompt, salt)
            if pending is not None:
                self._held_for_store[request.request_id] = pending
                held += 1
                continue
            if not self._admit(request, self.config.chunk_budget(budget)):
                if not self._running:
                    raise PageAccountingError(
                        f"request {request.request_id} cannot be admitted though no request holds pages"
                    )
                break
            del self._waiting[held]
            bisect.insort(self._running, request, key=lambda r: self._arrival[r.request_id])
            num_new = min(request.num_tokens - request.num_computed_tokens, self.config.chunk_budget(budget))
            chunks.append(self._chunk(request, num_new))
            budget -= num_new

        return SchedulerOutput(
            chunks=tuple(chunks),
            num_batched_tokens=self.config.max_num_batched_tokens - budget,
            preempted_request_ids=tuple(preempted),
        )

    def update(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, int],
        logprobs: Mapping[str, list[TokenLogprobs]] | None = None,
        prompt_logprobs: Mapping[str, tuple[int, list[TokenLogprobs]]] | None = None,
    ) -> list[Request]:
        """Apply a step: advance computed tokens, append sampled ones, cache newly full pages.

        ``sampled`` maps the id of every chunk with ``sample`` to its token. Chunks of requests
        aborted since ``schedule`` are skipped. Returns the requests that finished this step.
        ``logprobs`` and ``prompt_logprobs``: the runner's of this step (``ModelRunner``), kept
        with their requests.
        """
        size = self.config.page_size
        finished: list[Request] = []
        for chunk in output.chunks:
            request = self._requests.get(chunk.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue
            if chunk.start_position != request.num_computed_tokens:
                raise StaleSchedulerOutputError(
                    f"chunk for {chunk.request_id} starts at {chunk.start_position} but the request has "
                    f"computed {request.num_computed_tokens} tokens; apply each output once, in order"
                )
            request.num_computed_tokens += len(chunk.token_ids)
            if prompt_logprobs and chunk.request_id in prompt_logprobs:
                request.record_prompt_logprobs(*prompt_logprobs[chunk.request_id])
            if request.num_computed_tokens // size > chunk.start_position // size:
                self.kv_cache.cache_full_pages(
                    request.all_token_ids,
                    request.page_ids,
                    request.num_computed_tokens,
                    num_cached_pages_hint=chunk.start_position // size,
                    cache_salt=request.cache_salt,
                )
            if not chunk.sample:
                continue
            if chunk.request_id not in sampled:
                raise StaleSchedulerOutputError(f"no sampled token for {chunk.request_id}, which samples")
            request.append_output(sampled[chunk.request_id])
            if logprobs and chunk.request_id in logprobs:
                request.record_output_logprobs(1, logprobs[chunk.request_id])
            if request.is_finished:
                self._running.remove(request)
                self._finish(request, request.status)
                finished.append(request)
        return finished

    def check_integrity(self) -> None:
        """Raise ``PageAccountingError`` unless requests and the KV pool agree (O(all tokens): for tests)."""
        cache, size = self.kv_cache, self.config.page_size
        cache.check_integrity()
        if len(self._running) > self.config.max_num_seqs:
            raise PageAccountingError(f"{len(self._running)} running > max_num_seqs")
        queued = {r.request_id for r in self._running} | {r.request_id for r in self._waiting}
        if queued != set(self._requests) or len(self._running) + len(self._waiting) != len(self._requests):
            raise PageAccountingError("running + waiting do not match the known requests exactly once")
        arrivals = [self._arrival[r.request_id] for r in self._running]
        if arrivals != sorted(arrivals):
            raise PageAccountingError("running requests are not in arrival order")
        for request in self._waiting:
            rid = request.request_id
            if request.status not in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
                raise PageAccountingError(f"waiting request {rid} has status {request.status.name}")
            if request.page_ids or request.num_computed_tokens:
                raise PageAccountingError(f"waiting request {rid} holds pages or computed tokens")
        owners: dict[int, int] = {}
        for request in self._running:
            rid, pages = request.request_id, request.page_ids
            if request.status != RequestStatus.RUNNING:
                raise PageAccountingError(f"running request {rid} has status {request.status.name}")
            if len(set(pages)) != len(pages):
                raise PageAccountingError(f"request {rid} lists a page twice: {pages}")
            if not request.num_computed_tokens < request.num_tokens:
                raise PageAccountingError(f"running request {rid} has no token left to compute")
            if not request.num_computed_tokens <= len(pages) * size <= request.num_tokens - 1 + size:
                raise PageAccountingError(
                    f"request {rid}: {len(pages)} pages for {request.num_computed_tokens} computed "
                    f"of {request.num_tokens} tokens"
                )
            for page_id in pages:
                owners[page_id] = owners.get(page_id, 0) + 1
            computed = request.all_token_ids[: request.num_computed_tokens]
            hashes = block_hashes(computed, size, request.cache_salt)
            for page_id, expected in zip(pages, hashes, strict=False):
                cached = cache.cached_hash(page_id)
                if cached is not None and cached != expected:
                    raise PageAccountingError(f"request {rid} uses cached page {page_id} of another prefix")
        for page_id in range(cache.num_total_pages):
            count = owners.get(page_id, 0)
            refcount = cache.refcount(page_id)
            if count != refcount:
                raise PageAccountingError(f"page {page_id}: refcount {refcount} but {count} owning requests")
            if count > 1 and not cache.is_cached(page_id):
                raise PageAccountingError(f"page {page_id} is shared by {count} requests but not cached")

    def _allocate_for(self, request: Request, num_tokens: int) -> list[int] | None:
        """Pages to add so that ``request`` covers ``num_tokens`` positions, or ``None``."""
        missing = math.ceil(num_tokens / self.config.page_size) - len(request.page_ids)
        return self.kv_cache.allocate(missing) if missing > 0 else []

    def _admit(self, request: Request, budget: int) -> bool:
        """Match the cached prefix and take pages for the first chunk; all or nothing."""
        token_ids = request.all_token_ids
        # a prompt's logprobs need every position's logits, which its cached pages do not keep
        uncached = request.needs_prompt_logprobs
        found = PrefixMatch() if uncached else self.kv_cache.match(token_ids, request.cache_salt)
        page_ids, num_cached = found.page_ids, found.num_tokens
        num_new = min(len(token_ids) - num_cached, budget)
        num_pages = math.ceil((num_cached + num_new) / self.config.page_size)
        new_pages = self.kv_cache.allocate(num_pages - len(page_ids))
        if new_pages is None:
            if not uncached:
                self.kv_cache.undo_match(page_ids, len(token_ids))
            return False
        if request.num_preemptions == 0:
            request.num_cached_tokens = num_cached
            request.num_cached_host_tokens, request.num_cached_store_tokens = (
                found.host_tokens,
                found.store_tokens,
            )
        request.page_ids = page_ids + new_pages
        request.num_computed_tokens = num_cached
        request.status = RequestStatus.RUNNING
        return True

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        end = start + num_new
        prompt, outputs = request.prompt_token_ids, request.output_token_ids
        if start >= len(prompt):
            token_ids = tuple(outputs[start - len(prompt) : end - len(prompt)])
        else:
            token_ids = tuple(prompt[start:end]) + tuple(outputs[: max(0, end - len(prompt))])
        sample = end == request.num_tokens
        targets = tuple(prompt[start + 1 : end + 1]) if request.needs_prompt_logprobs else ()
        return ScheduledChunk(
            request_id=request.request_id,
            token_ids=token_ids,
            start_position=start,
            page_ids=tuple(request.page_ids),
            sample=sample,
            sampling=request.sampling,
            output_index=len(outputs),
            history=(tuple(prompt), tuple(outputs)) if sample and request.sampling.needs_history else None,
            prompt_logprob_targets=targets,
        )

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request.page_ids)
        request.page_ids = []
        request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self._waiting.appendleft(request)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        self.kv_cache.free(request.page_ids)
        request.page_ids = []
        request.status = status
        del self._requests[request.request_id]
        del self._arrival[request.request_id]
