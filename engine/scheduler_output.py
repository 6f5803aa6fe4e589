"""What a scheduler hands its runner for one step: the chunks of tokens whose KV to compute, and
which of them sample a token. Every scheduler (colocated, prefill, decode) returns one; the
runner turns it into tensors; only ids and counts, no tensors here."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.wire.request_params import SamplingParams


class StaleSchedulerOutputError(RuntimeError):
    """``update`` got an output that does not follow from the requests' current state."""


@dataclass(frozen=True)
class ScheduledChunk:
    """Compute KV for positions ``start_position .. start_position + len(token_ids) - 1``.

    ``page_ids`` is the request's whole page table, covering every position up to the chunk's
    end. With ``sample`` the request has then computed all its known tokens and the runner
    samples output token number ``output_index`` from the last position's logits.

    A verify chunk (speculative decoding) ends with ``draft_token_ids``: ``token_ids`` is the
    last output then the drafts, and the runner samples outputs ``output_index ..
    output_index + len(draft_token_ids)`` at its positions and keeps those the drafts earn
    (``engine/speculation.py``). ``next_token_id``: the token after the chunk when the request
    has it (a prefill chunk before the prompt's last), which the MTP layer's last row reads.
    ``history``: the request's prompt and its outputs before ``output_index``, on a sampling
    chunk of a request whose sampling reads them only (its penalties, its guide; ``None`` elsewhere).
    ``prompt_logprob_targets``: for a request that asked for its prompt's logprobs, the prompt
    tokens the chunk's first rows predict (row ``j``'s is the token at ``start_position + j +
    1``); the runner gives their logprobs (``ModelRunner.prompt_logprobs``).
    """

    request_id: str
    token_ids: tuple[int, ...]
    start_position: int
    page_ids: tuple[int, ...]
    sample: bool
    sampling: SamplingParams
    output_index: int
    draft_token_ids: tuple[int, ...] = ()
    draft_room: int = 0  # drafts the scheduler holds pages for (a decode step; 0 elsewhere)
    next_token_id: int | None = None
    history: tuple[tuple[int, ...], tuple[int, ...]] | None = None
    prompt_logprob_targets: tuple[int, ...] = ()

    @property
    def num_sampled(self) -> int:
        """Positions the runner samples at: the last, or the last plus each draft's."""
        return (1 + len(self.draft_token_ids)) if self.sample else 0


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    num_batched_tokens: int
    preempted_request_ids: tuple[str, ...]

    @property
    def is_empty(self) -> bool:
        return not self.chunks
