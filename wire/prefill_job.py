"""A prefill job and what the prefill scheduler reports about it.

A decode rank reserves pages for a request's prompt and sends a ``PrefillJob`` naming them; the
prefill rank computes the prompt's KV, samples one token and writes every page of the prompt
(cached prefix included) into the reserved pages::

    prompt     [t0 .. t63][t64 .. t127][t128 .. t150]        ceil(151 / 64) = 3 pages
    this rank  src_page_ids = (17, 4, 30)                      token order
    decode     destination.page_ids = (2, 9, 5)                same count, same order

A job is ``WAITING`` (queued), then ``RUNNING`` (holding pages, computed chunk by chunk), then
``SENDING_KV`` (its pages still held while the transport reads them) until the caller reports
the transfer over; these are the request statuses of ``engine/request.py``. The outcomes are
``PrefillDone`` (compute finished, transfer pending) and ``PrefillExpired`` (its deadline passed
before it started). Each job is answered as soon as it reaches the prefill rank's loop
(``PrefillJobAnswer``): taken, or refused with why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.kvtransfer.types import KVDestination
from tandem.wire.request_params import InvalidRequestError, SamplingParams, check_prompt


@dataclass(frozen=True, kw_only=True)
class PrefillJob:
    """Compute the KV of ``prompt_token_ids`` into ``destination`` and sample one token.

    ``output_index`` is the index of the token sampled, which keys a seeded draw: a re-prefill
    after decode-side preemption carries the prompt plus the tokens generated so far and samples
    a later index (decode ignores that token, but the draw stays deterministic).
    ``deadline_s`` is absolute, on the monotonic clock the prefill scheduler is given as ``now``;
    the receiving actor re-bases it if the job crossed machines.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    output_index: int = 0
    destination: KVDestination
    deadline_s: float
    # the request's cache salt: the prompt's pages are matched and cached under its chain
    # (``engine/prefix_cache.py`` ``chain_root``)
    cache_salt: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def num_pages(self, page_size: int) -> int:
        """Pages that hold the whole prompt (the last one perhaps partial)."""
        return math.ceil(len(self.prompt_token_ids) / page_size)

    def validate(self, vocab_size: int, max_model_len: int, page_size: int) -> None:
        """Raise ``InvalidRequestError`` naming the first field that is wrong."""
        if not isinstance(self.request_id, str) or not self.request_id:
            raise InvalidRequestError("request_id", f"must be a non-empty string, got {self.request_id!r}")
        if not isinstance(self.prompt_token_ids, tuple):
            raise InvalidRequestError(
                "prompt_token_ids", f"must be a tuple, got {type(self.prompt_token_ids).__name__}"
            )
        try:
            check_prompt(list(self.prompt_token_ids), vocab_size, max_model_len)
        except InvalidRequestError as error:  # one name for the field, whichever rule it broke
            raise InvalidRequestError("prompt_token_ids", error.message) from None
        if not isinstance(self.sampling, SamplingParams):
            raise InvalidRequestError(
                "sampling", f"must be SamplingParams, got {type(self.sampling).__name__}"
            )
        self.sampling.validate(vocab_size)
        if self.sampling.seed is None and not self.sampling.greedy:
            # the first token is drawn here: without the request's seed it would share every
            # other unseeded job's draw (a decode rank seeds every request it is given)
            raise InvalidRequestError("seed", "a job that samples must carry its request's seed")
        index = self.output_index
        if not isinstance(index, int) or isinstance(index, bool) or index < 0:
            raise InvalidRequestError("output_index", f"must be an integer >= 0, got {index!r}")
        if index >= self.sampling.max_tokens or index >= len(self.prompt_token_ids):
            raise InvalidRequestError(
                "output_index",
                f"{index} is past max_tokens {self.sampling.max_tokens} or the "
                f"{len(self.prompt_token_ids)} tokens a re-prefill carries",
            )
        self._validate_destination(page_size)
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise InvalidRequestError(
                "cache_salt", f"must be a non-empty string or None, got {self.cache_salt!r}"
            )
        if not isinstance(self.deadline_s, int | float) or not math.isfinite(self.deadline_s):
            raise InvalidRequestError(
                "deadline_s", f"must be a finite number of seconds, got {self.deadline_s!r}"
            )

    def _validate_destination(self, page_size: int) -> None:
        destination = self.destination
        if not isinstance(destination, KVDestination):
            raise InvalidRequestError(
                "destination", f"must be a KVDestination, got {type(destination).__name__}"
            )
        page_ids = destination.page_ids
        expected = self.num_pages(page_size)
        if not isinstance(page_ids, tuple) or len(page_ids) != expected:
            count = len(page_ids) if isinstance(page_ids, tuple) else type(page_ids).__name__
            raise InvalidRequestError(
                "destination.page_ids",
                f"{count} pages for a {len(self.prompt_token_ids)}-token prompt; "
                f"a tuple of ceil(prompt / {page_size}) = {expected} page ids is needed",
            )
        if any(not isinstance(p, int) or isinstance(p, bool) or p < 0 for p in page_ids):
            raise InvalidRequestError("destination.page_ids", f"must be integers >= 0, got {page_ids}")
        if len(set(page_ids)) != len(page_ids):
            raise InvalidRequestError("destination.page_ids", f"lists a page twice: {page_ids}")


@dataclass(frozen=True)
class PrefillJobAnswer:
    """A prefill rank's answer to one job, sent back to its decode rank at once: taken
    (``refusal`` None) or refused, with why. A refused job holds nothing on the prefill rank
    and nothing of it is ever written: its decode rank may free the pages it reserved for it
    at once instead of at the deadline."""

    request_id: str  # the job's (its transfer's key)
    prefill_rank: str
    refusal: str | None = None

    @property
    def accepted(self) -> bool:
        return self.refusal is None


@dataclass(frozen=True)
class PrefillTimings:
    """``queue_s``: arrival to first chunk scheduled; ``compute_s``: first chunk to last chunk done."""

    queue_s: float
    compute_s: float

    def as_dict(self) -> dict[str, float]:
        return {"prefill_queue_s": self.queue_s, "prefill_compute_s": self.compute_s}


@dataclass(frozen=True)
class PrefillDone:
    """A job's KV is computed and its first token sampled; the transfer is now the caller's.

    ``src_page_ids`` are this rank's pages in token order, covering the whole prompt (cached
    prefix pages included), one per ``destination.page_ids`` entry. They stay referenced until
    the caller reports ``transfer_over``. ``cached_host_tokens`` and ``cached_store_tokens`` are
    the parts of ``cached_tokens`` loaded from the host tier and the store.
    """

    request_id: str
    first_token: int
    cached_tokens: int
    src_page_ids: tuple[int, ...]
    destination: KVDestination
    timings: PrefillTimings
    cached_host_tokens: int = 0
    cached_store_tokens: int = 0


@dataclass(frozen=True)
class PrefillExpired:
    """A job whose deadline passed while it was queued; it was dropped before using any page.
    Nothing is sent: the decode rank's own deadline for this transfer has passed too, and it
    frees ``destination`` when its transport reports the transfer over."""

    request_id: str
    destination: KVDestination
    deadline_s: float
    queue_s: float

    @property
    def message(self) -> str:
        return f"prefill of {self.request_id} did not start before its deadline (queued {self.queue_s:.3f}s)"
