"""The checks a rank makes of a request it is given, before it queues it: a new request against
the rank's limits (its context, its pool), a resumed one's outputs against its prompt, and the
most pages a request can hold. Torch-free: the frontend sizes requests with ``max_kv_pages``."""

from __future__ import annotations

from tandem.engine.request import Request, RequestStatus
from tandem.wire.messages import RankRequest
from tandem.wire.request_params import InvalidRequestError, check_prompt
from tandem.wire.request_params import max_kv_pages as max_kv_pages


def admit_new_request(
    request: Request, max_model_len_cap: int, page_size: int, num_pages: int, resumed: bool = False
) -> None:
    """Check a new request against a rank's limits (``InvalidRequestError`` naming the field) and
    prepare it: its context capped at ``max_model_len_cap``, nothing computed yet. A ``resumed``
    request (moved from a failed decode rank) may come with the outputs its client already has."""
    request.sampling.validate()
    prompt = request.prompt_token_ids
    if not prompt:
        raise InvalidRequestError("prompt", "must contain at least one token")
    if any(not isinstance(t, int) or t < 0 for t in prompt):
        raise InvalidRequestError("prompt", "token ids must be integers >= 0")
    max_model_len = min(request.max_model_len or max_model_len_cap, max_model_len_cap)
    if len(prompt) >= max_model_len:
        raise InvalidRequestError(
            "prompt", f"has {len(prompt)} tokens; max_model_len {max_model_len} leaves no room for output"
        )
    if (
        request.status != RequestStatus.WAITING
        or request.page_ids
        or (request.output_token_ids and not resumed)
    ):
        raise InvalidRequestError("request", "must be new: WAITING, with no outputs or pages")
    pages_needed = max_kv_pages(len(prompt), request.sampling.max_tokens, max_model_len, page_size)
    if pages_needed > num_pages:
        raise InvalidRequestError(
            "prompt",
            f"prompt plus max_tokens needs {pages_needed} pages but the pool has only "
            f"{num_pages}; shorten the prompt or lower max_tokens",
        )
    request.max_model_len = max_model_len
    request.num_computed_tokens = 0


def resumed_outputs(r: RankRequest, vocab_size: int, max_model_len: int) -> list[int]:
    """The outputs a resumed request already has, checked: token ids of the vocabulary, fewer
    than ``max_tokens`` (one is still to come), and room for the next one in the context."""
    outputs = list(r.resume_output_ids)
    if any(not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size for t in outputs):
        raise InvalidRequestError("resume_output_ids", f"must be token ids in [0, {vocab_size})")
    if len(outputs) >= r.sampling.max_tokens:
        raise InvalidRequestError("resume_output_ids", f"{len(outputs)} is not below max_tokens")
    if len(r.prompt_token_ids) + len(outputs) >= max_model_len:
        raise InvalidRequestError(
            "resume_output_ids", f"prompt and outputs fill the context of {max_model_len}"
        )
    return outputs


def request_of(
    r: RankRequest, vocab_size: int, eos: frozenset[int], max_model_len: int, page_size: int, num_pages: int
) -> Request:
    """The rank's ``Request`` for a submitted one, checked against the rank's limits (the
    errors name the field): its sampling, its prompt in the vocabulary and the context, its
    pages in the pool, the outputs a resumed one comes with. The frontend seeds every request;
    one submitted without gets its own seed here."""
    r.sampling.validate(vocab_size)
    prompt = list(r.prompt_token_ids)
    check_prompt(prompt, vocab_size, max_model_len, "prompt")
    request = Request(r.request_id, prompt, r.sampling.seeded(), eos, max_model_len)
    request.cache_salt = r.cache_salt
    admit_new_request(request, max_model_len, page_size, num_pages)
    if r.resume_output_ids:
        request.output_token_ids = resumed_outputs(r, vocab_size, max_model_len)
    return request
