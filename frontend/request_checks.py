"""The checks both edges (gRPC and the OpenAI API) make of a request before it is admitted, with
one wording: prompt sizes against the context, stop token ids, and the sampling parameters (a
greedy temperature passed on as 0); and, once routed, a request's size against the ranks' KV.
Each raises ``InvalidRequestError`` naming the field as the caller calls it; the OpenAI edge
turns that into its own error shape."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tandem.wire.request_params import InvalidRequestError, SamplingParams, context_overflow, max_kv_pages
from tandem.wire.routing_view import RoutingView

MAX_STOP_TOKEN_IDS = 64
TEXT_CHARS_PER_TOKEN = 16  # a text longer than this many characters per context token cannot fit


def check_text_fits(field: str, chars: int, context: int) -> None:
    """A text so long that no tokenisation could fit it in ``context`` tokens (checked before it
    is tokenised)."""
    if chars > TEXT_CHARS_PER_TOKEN * context:
        raise InvalidRequestError(
            field,
            f"{chars} characters cannot fit the context of {context} tokens "
            f"(at most {TEXT_CHARS_PER_TOKEN * context} characters)",
        )


def check_ids_fit(field: str, prompt_tokens: int, context: int) -> None:
    """A prompt of token ids that leaves no room for one generated token (checked before any
    scan of the ids)."""
    if prompt_tokens >= context:
        raise InvalidRequestError(field, context_overflow(prompt_tokens, context))


def stop_token_ids(field: str, ids: Sequence[int], vocab_size: int) -> tuple[int, ...]:
    """The stop token ids, each once and in order, every one in the vocabulary."""
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequestError(field, f"{len(ids)} ids; at most {MAX_STOP_TOKEN_IDS}")
    stops = tuple(dict.fromkeys(ids))
    bad = [t for t in stops if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(field, f"token id {bad[0]} is outside the vocabulary [0, {vocab_size})")
    return stops


def checked_sampling(
    sampling: SamplingParams, prefix: str = "", vocab_size: int | None = None
) -> SamplingParams:
    """``sampling`` validated (a bad field named ``prefix + field``; with ``vocab_size``, a token
    id outside the vocabulary too), a greedy temperature as 0."""
    if not math.isfinite(sampling.temperature):
        raise InvalidRequestError(f"{prefix}temperature", f"must be finite, got {sampling.temperature}")
    try:
        sampling.validate(vocab_size)
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{prefix}{exc.field}", exc.message) from None
    return sampling.canonical()


def check_capacity(view: RoutingView, prompt_tokens: int, max_tokens: int, context: int) -> None:
    """A request no rank of ``view`` could ever hold is refused, naming the field to change."""
    if prompt_tokens > view.prefill_capacity_tokens:
        raise InvalidRequestError(
            "prompt",
            f"{prompt_tokens} tokens exceed a prefill rank's KV pool of {view.prefill_capacity_tokens}",
        )
    size = view.page_size
    pages = max_kv_pages(prompt_tokens, max_tokens, context, size)
    if pages * size > view.decode_capacity_tokens:
        raise InvalidRequestError(
            "sampling.max_tokens",
            f"the prompt ({prompt_tokens} tokens) plus max_tokens ({max_tokens}) need more KV than a "
            f"decode rank holds ({view.decode_capacity_tokens} tokens); lower max_tokens",
        )
