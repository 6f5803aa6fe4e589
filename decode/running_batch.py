"""A decode rank's running batch: its RUNNING requests in arrival order, and each step's plan.

A step decodes one token for each of the first ``max_num_seqs`` running requests (``plan``). A
request whose next token needs a page when none is free preempts the newest running request
(perhaps itself, never one planned earlier in the step); the caller's ``preempt`` takes the
victim back to its queue. Held requests (their grammar still compiles) sit the step out and keep
their pages.

Speculative decoding: each planned request then gets pages for up to its draft room (cut to
``draft_limit``) from those left free; drafts never preempt a request nor take the page another
one's next token needs. ``with_drafts`` puts the drafts in; ``apply`` appends a verify step's
tokens in order until a stop condition, and frees the pages past the next token's, which only
rejected drafts wrote, so a running request holds the same pages between steps with drafts as
without. Pure bookkeeping, torch-free.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Container, Iterator, Mapping, Sequence

from tandem.decode.decode_request import DecodeRequest
from tandem.decode.types import DecodeSchedulerConfig
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler_output import ScheduledChunk, SchedulerOutput, StaleSchedulerOutputError
from tandem.wire.request_params import FinishReason


class RunningBatch:
    def __init__(self, config: DecodeSchedulerConfig, kv_cache: PrefixCache) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self._running: list[DecodeRequest] = []  # sorted by ``order``

    def __len__(self) -> int:
        return len(self._running)

    def __iter__(self) -> Iterator[DecodeRequest]:
        return iter(self._running)

    def add(self, entry: DecodeRequest) -> None:
        """``entry`` runs (its KV is here): in its place by arrival."""
        entry.request.status = RequestStatus.RUNNING
        bisect.insort(self._running, entry, key=lambda e: e.order)

    def remove(self, entry: DecodeRequest) -> None:
        self._running.remove(entry)

    def requests(self) -> list[Request]:
        """The requests the next ``plan`` decodes, in order (the first ``max_num_seqs``)."""
        return [e.request for e in self._running[: self.config.max_num_seqs]]

    def draft_limit(self, request: Request, k: int) -> int:
        """How many of ``k`` drafts a verify step of ``request`` can use: a step gives at most
        one token more than its drafts, and never past ``max_tokens`` or the context."""
        max_len = request.max_model_len or self.config.max_model_len
        left = min(request.sampling.max_tokens - len(request.output_token_ids), max_len - request.num_tokens)
        return max(0, min(k, left - 1))

    def plan(
        self,
        draft_room: Mapping[str, int],
        held: Container[str],
        preempt: Callable[[DecodeRequest], None],
    ) -> SchedulerOutput:
        """One decode step: a chunk of one token for each request planned, each with its pages
        and its draft room; ``preempt`` takes each victim (already out of the batch)."""
        preempted: list[str] = []
        planned: list[DecodeRequest] = []
        index = 0
        while index < len(self._running) and len(planned) < self.config.max_num_seqs:
            entry = self._running[index]
            request = entry.request
            if request.request_id in held:
                index += 1
                continue
            new_pages = self._pages_for(request, request.num_tokens)
            while new_pages is None:
                victim = self._running.pop()  # the newest; the planned ones sit before ``index``
                preempt(victim)
                preempted.append(victim.request.request_id)
                if victim is entry:
                    break
                new_pages = self._pages_for(request, request.num_tokens)
            if new_pages is None:
                break
            request.page_ids.extend(new_pages)
            planned.append(entry)
            index += 1
        chunks = []
        for entry in planned:
            entry.num_drafts = self._reserve_drafts(entry.request, draft_room.get(entry.request_id, 0))
            chunks.append(_chunk(entry))
        return SchedulerOutput(
            chunks=tuple(chunks), num_batched_tokens=len(chunks), preempted_request_ids=tuple(preempted)
        )

    def apply(
        self,
        output: SchedulerOutput,
        sampled: Mapping[str, int | Sequence[int]],
        entries: Mapping[str, DecodeRequest],
    ) -> list[tuple[DecodeRequest, FinishReason]]:
        """Apply a step's tokens: ``sampled`` maps each chunk's request id to its token, or to
        the tokens its verify step gave. They are appended in order and a stop condition (EOS,
        a stop token, ``max_tokens``, the context) cuts them there. Chunks of requests no longer
        running (aborted since ``plan``) are skipped. The finished ones leave the batch and are
        returned with their reasons (their pages are the caller's to free)."""
        finished: list[tuple[DecodeRequest, FinishReason]] = []
        for chunk in output.chunks:
            entry = entries.get(chunk.request_id)
            if entry is None or entry.request.status is not RequestStatus.RUNNING:
                continue
            request = entry.request
            tokens = _checked_tokens(chunk, request, sampled)
            entry.num_drafts, entry.forked = 0, False
            for token in tokens:
                request.num_computed_tokens += 1
                request.append_output(token)
                if request.is_finished:
                    break
            if request.is_finished:
                self._running.remove(entry)
                finished.append((entry, request.finish_reason or FinishReason.LENGTH))
            elif chunk.draft_room:
                self._trim_pages(request)
        return finished

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

    def _trim_pages(self, request: Request) -> None:
        """Free the pages past the next token's: only rejected drafts' KV was written there."""
        keep = math.ceil(request.num_tokens / self.config.page_size)
        if len(request.page_ids) > keep:
            self.kv_cache.free(request.page_ids[keep:])
            del request.page_ids[keep:]


def with_drafts(output: SchedulerOutput, drafts: Mapping[str, Sequence[int]]) -> SchedulerOutput:
    """``output`` with each chunk's drafts after its token (at most its ``draft_room``)."""
    chunks = []
    for chunk in output.chunks:
        draft = tuple(drafts.get(chunk.request_id, ()))[: chunk.draft_room]
        if draft:
            chunk = dataclasses.replace(chunk, token_ids=(*chunk.token_ids, *draft), draft_token_ids=draft)
        chunks.append(chunk)
    return dataclasses.replace(
        output, chunks=tuple(chunks), num_batched_tokens=sum(len(c.token_ids) for c in chunks)
    )


def _chunk(entry: DecodeRequest) -> ScheduledChunk:
    """A planned request's chunk: its last token (a forked one's: its prompt's last) at its
    position, with its pages and its draft room."""
    request = entry.request
    history = None
    if request.sampling.needs_history:
        history = (tuple(request.prompt_token_ids), tuple(request.output_token_ids))
    return ScheduledChunk(
        request_id=request.request_id,
        token_ids=(request.all_token_ids[-1],),
        start_position=request.num_tokens - 1,
        page_ids=tuple(request.page_ids),
        sample=True,
        sampling=request.sampling,
        output_index=len(request.output_token_ids),
        draft_room=entry.num_drafts,
        history=history,
    )


def _checked_tokens(
    chunk: ScheduledChunk, request: Request, sampled: Mapping[str, int | Sequence[int]]
) -> tuple[int, ...]:
    """The tokens ``sampled`` gives ``chunk``; ``StaleSchedulerOutputError`` when the plan is
    not the request's latest or the tokens cannot come from it."""
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
            f"{len(tokens)} tokens for {chunk.request_id}, whose step had {len(chunk.draft_token_ids)} drafts"
        )
    return tokens
