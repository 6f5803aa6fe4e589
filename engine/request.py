"""The one request-state class.

The scheduler that owns a request is the only thing that changes it; everything else reads it.
One status enum serves every rank (a colocated rank never waits for or sends KV; a prefill rank
never decodes). Statuses are ordered with the terminal ones last, so ``is_finished`` is
``status > PREEMPTED``::

    WAITING ──▶ RUNNING ──▶ FINISHED_*                       colocated: prefill + decode here
    WAITING ──▶ RUNNING ──▶ SENDING_KV ──▶ (transfer over)   prefill: compute, then pages are read
    WAITING ──▶ WAITING_FOR_KV ──▶ RUNNING ──▶ FINISHED_*    decode: pages reserved, KV written
        ▲            │ (a failed transfer, retried)   │
        └────────────┴──── PREEMPTED ◀── (no page) ───┘
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tandem.wire.logprobs import TokenLogprobs
from tandem.wire.request_params import FinishReason, SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0  # queued: no pages, nothing computed
    WAITING_FOR_KV = 1  # decode: pages reserved, a prefill rank writes them
    RUNNING = 2  # computing (prefill chunks, or one token a step)
    SENDING_KV = 3  # prefill: computed; its pages are held while the transfer reads them
    PREEMPTED = 4  # back in the queue without pages, outputs kept, to be recomputed
    FINISHED_STOPPED = 5
    FINISHED_LENGTH = 6
    FINISHED_ABORTED = 7
    FINISHED_ERROR = 8


FINISHED_STATUS = {
    FinishReason.STOP: RequestStatus.FINISHED_STOPPED,
    FinishReason.LENGTH: RequestStatus.FINISHED_LENGTH,
    FinishReason.ABORT: RequestStatus.FINISHED_ABORTED,
    FinishReason.ERROR: RequestStatus.FINISHED_ERROR,
}
_FINISH_REASONS = {status: reason for reason, status in FINISHED_STATUS.items()}


@dataclass
class Request:
    """A request's tokens, progress and pages.

    ``num_computed_tokens`` counts the leading tokens of ``all_token_ids`` whose KV is in the
    pool (cached prefix included); ``page_ids[i]`` holds positions ``[i*page_size, (i+1)*page_size)``.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int | None = None
    arrival_s: float = 0.0
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_cached_host_tokens: int = 0  # of the cached ones, loaded from the host tier
    num_cached_store_tokens: int = 0  # and from the shared store
    page_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # when asked for (``SamplingParams.logprobs``/``prompt_logprobs``): each output token's, in
    # order (``None`` for one that came without: a resumed request's earlier outputs), and each
    # prompt position's from its first computation (``[0]`` is ``None``: no logits precede it)
    output_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    # mixed into its prompt's block chain (``prefix_cache.chain_root``): only requests with the
    # same salt share cached pages; None: the unsalted chain
    cache_salt: str | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Asked for its prompt's logprobs and has not got all of them yet."""
        wanted = self.sampling.prompt_logprobs is not None
        return wanted and len(self.prompt_logprobs) < len(self.prompt_token_ids)

    def record_prompt_logprobs(self, first: int, entries: list[TokenLogprobs]) -> None:
        """The logprobs of prompt positions ``first`` onwards (a recomputation rewrites them)."""
        if not self.prompt_logprobs:
            self.prompt_logprobs.append(None)
        if not 1 <= first <= len(self.prompt_logprobs):
            raise ValueError(f"{self.request_id}: prompt logprobs from {first} leave a gap")
        self.prompt_logprobs[first : first + len(entries)] = entries

    def record_output_logprobs(self, given: int, entries: list[TokenLogprobs]) -> None:
        """The logprobs of the ``given`` outputs appended last: the first ``given`` entries
        (a verify step's rows past the tokens it kept are dropped)."""
        before = len(self.output_token_ids) - given
        self.output_logprobs += [None] * (before - len(self.output_logprobs))
        del self.output_logprobs[before:]
        self.output_logprobs += entries[:given]

    def output_logprobs_from(self, start: int) -> list[TokenLogprobs | None]:
        """The logprobs of outputs ``start`` onwards, one an output, when it asked (else none)."""
        if self.sampling.logprobs is None:
            return []
        entries = self.output_logprobs[start:]
        return entries + [None] * (len(self.output_token_ids) - start - len(entries))

    @property
    def is_finished(self) -> bool:
        return self.status > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def append_output(self, token_id: int) -> None:
        """Record a sampled token and finish the request if it hit a stop condition."""
        self.output_token_ids.append(token_id)
        sampling = self.sampling
        is_eos = not sampling.ignore_eos and token_id in self.eos_token_ids
        if token_id in sampling.stop_token_ids or is_eos:
            self.status = RequestStatus.FINISHED_STOPPED
        elif len(self.output_token_ids) >= sampling.max_tokens or (
            self.max_model_len is not None and self.num_tokens >= self.max_model_len
        ):
            self.status = RequestStatus.FINISHED_LENGTH
