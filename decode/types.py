"""The decode scheduler's config and what it hands its caller: reservations to send prefill
jobs for, finished records, abort outcomes, typed errors."""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.engine.config_checks import (
    check_context,
    check_non_negative_int,
    check_positive_ints,
    check_seconds,
)
from tandem.engine.request import Request
from tandem.kvtransfer.types import KVDestination
from tandem.wire.request_params import FinishReason

if TYPE_CHECKING:
    from tandem.decode.decode_request import DecodeRequest


class AbortAction(enum.Enum):
    DONE = "done"  # finished now and its pages freed; the record is in ``AbortResult.finished``
    CANCEL_TRANSFER = "cancel_transfer"  # abort the KV transfer, then call ``kv_failed``
    UNKNOWN = "unknown"  # no such unfinished request (already finished, or never here)


@dataclass(frozen=True)
class Reservation:
    """Pages reserved for one request's prefill; the caller sends a prefill job writing into them.

    The prefill job's prompt is ``request.all_token_ids[:num_prompt_tokens]``. For a new request
    that is its prompt and the token the prefill side samples becomes output 0. For a request
    recomputed after preemption it is every token but the last sampled one (which becomes the
    next decode input), and the token the prefill side samples is ignored. ``attempt`` counts
    this request's reservations from 0; pass it back to ``kv_arrived``/``kv_failed`` so that a
    notification of an earlier attempt is never taken for the current one.
    """

    request_id: str
    page_ids: tuple[int, ...]
    num_prompt_tokens: int
    deadline_s: float
    attempt: int = 0

    def destination(self, rank: str, incarnation: int) -> KVDestination:
        return KVDestination(rank=rank, incarnation=incarnation, page_ids=self.page_ids)


@dataclass(frozen=True)
class DecodeFinished:
    """A request the decode scheduler no longer owns; its pages are free and its status is the
    FINISHED_* one of ``finish_reason``. ``error`` says what went wrong for ERROR, else ``None``.
    """

    request: Request
    finish_reason: FinishReason
    error: str | None = None
    num_kv_retries: int = 0
    # the pages it held and the leading tokens whose KV they hold, as they were when it finished:
    # freed, but not written again before the step that finished it is over (the write-back's)
    page_ids: tuple[int, ...] = ()
    num_computed_tokens: int = 0
    record: DecodeRequest | None = None  # the scheduler's record of it (``decode_request``)

    @property
    def request_id(self) -> str:
        return self.request.request_id


@dataclass(frozen=True)
class AbortResult:
    action: AbortAction
    finished: DecodeFinished | None = None


class KVNotificationError(ValueError):
    """A KV notification whose fields cannot belong to the reservation it names: the prefill
    side sent a wrong first token or cached-token count."""

    def __init__(self, request_id: str, field: str, message: str) -> None:
        super().__init__(f"KV notification for {request_id}: {field} {message}")
        self.request_id = request_id
        self.field = field


@dataclass(frozen=True, kw_only=True)
class DecodeSchedulerConfig:
    """One decode rank's limits. ``max_reservations_in_flight`` caps requests waiting for KV at
    once; ``max_kv_retries`` caps how often one request's failed transfer is retried."""

    num_pages: int
    page_size: int = 64
    max_num_seqs: int = 64
    max_model_len: int
    kv_wait_timeout_s: float = 30.0
    max_reservations_in_flight: int = 64
    max_kv_retries: int = 1

    def __post_init__(self) -> None:
        check_positive_ints(
            self, "num_pages", "page_size", "max_num_seqs", "max_model_len", "max_reservations_in_flight"
        )
        check_context(self.max_model_len)
        check_seconds("kv_wait_timeout_s", self.kv_wait_timeout_s)
        check_non_negative_int("max_kv_retries", self.max_kv_retries)
