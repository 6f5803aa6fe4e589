"""What crosses between Tandem's processes: requests to ranks, token streams, results and their
bills, rank and transfer ids, rank stats. Typed and frozen, and free of torch and the model, so
the frontend, the controller and the CLI import them without loading either.

::

    frontend ──RankRequest──▶ decode rank ──StreamBatch (TokenDelta.., RequestResult..)──▶ frontend
    CLI / group ──RankRequest──▶ colocated rank ──RequestResult (collect)──▶ CLI / group
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tandem.engine.request import FinishReason, SamplingParams


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # prefill and decode on one rank, no transfer


@dataclass(frozen=True, order=True)
class RankId:
    """One rank: its group and its place in it. ``name`` is the string other parts key ranks by
    (transport peers, the router, Ray logs); it is made here and never parsed back."""

    group_id: str
    rank: int

    @property
    def name(self) -> str:
        return f"{self.group_id}-r{self.rank}"

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True)
class TransferId:
    """One attempt at moving a request's KV; a retry gets the next ``attempt``, so a late
    notification of an earlier attempt never counts for the current one. ``key`` names the
    transfer to the transport; the decode rank maps keys back to ids, it never parses them."""

    request_id: str
    attempt: int

    @property
    def key(self) -> str:
        return f"{self.request_id}#{self.attempt}"


@dataclass(frozen=True)
class RankRequest:
    """A request addressed to a rank. ``prefill_rank`` is the router's choice of prefill rank
    (decode ranks only); with ``frontend`` set, the decode rank pushes the tokens and the result
    to that named frontend actor instead of reporting them through ``collect``."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    sampling: SamplingParams
    prefill_rank: RankId | None = None
    frontend: str | None = None


@dataclass(frozen=True)
class Bill:
    """What one request cost and where its time went. Every duration is measured on the rank
    that holds the request, from its arrival there, as the difference of two readings of that
    rank's monotonic clock; the prefill figures are the prefill rank's own measurements.

    ``kv_transfer_s`` is the sender's span from its first write to posting the last one;
    ``kv_transfer_exposed_s`` is the wait for the KV beyond the prefill's queue and compute time.
    """

    prompt_tokens: int = 0
    cached_tokens: int = 0
    output_tokens: int = 0
    kv_bytes: int = 0
    kv_wait_s: float = 0.0
    kv_transfer_s: float = 0.0
    kv_transfer_exposed_s: float = 0.0
    reservation_wait_s: float = 0.0
    prefill_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    ttft_s: float = 0.0
    token_times_s: tuple[float, ...] = ()
    decode_s: float = 0.0
    e2e_s: float = 0.0

    @property
    def new_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.cached_tokens


@dataclass(frozen=True)
class RequestResult:
    """How a request ended on its rank. ``prefill_rank`` is where its KV was computed (``None``
    on a colocated rank, or when it never got that far)."""

    request_id: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    bill: Bill
    decode_rank: RankId | None = None
    prefill_rank: RankId | None = None
    error: str | None = None


@dataclass(frozen=True)
class TokenDelta:
    """New output tokens of one request: indices ``start_index`` onwards, with the wall-clock
    time (Unix seconds) each became known on the decode rank."""

    request_id: str
    start_index: int
    token_ids: tuple[int, ...]
    times_unix_s: tuple[float, ...]


@dataclass(frozen=True)
class StreamBatch:
    """What one decode rank pushes to one frontend after a loop iteration."""

    decode_rank: RankId
    deltas: tuple[TokenDelta, ...] = ()
    finished: tuple[RequestResult, ...] = ()


@dataclass(frozen=True)
class LoopStats:
    """The step loop's own counters (every role)."""

    steps: int = 0
    idle_waits: int = 0
    agree_s: float = 0.0  # in the one-integer all-reduce that decides whether to step
    step_s: float = 0.0


@dataclass(frozen=True)
class RankStats:
    """One rank as it reports itself. Request and page counts are the role's (a prefill rank
    has no ``running``, a decode rank no ``computing``); expert-parallel figures are the MoE
    layers' totals since start."""

    rank: RankId
    role: Role
    incarnation: int
    loop: LoopStats = field(default_factory=LoopStats)
    queued: int = 0
    running: int = 0
    waiting_for_kv: int = 0
    computing: int = 0
    transferring: int = 0
    free_pages: int = 0
    total_pages: int = 0
    cached_pages: int = 0
    kv_bytes_sent: int = 0
    sends_in_flight: int = 0
    receives_in_flight: int = 0
    local_experts: int = 0
    forward_s: float = 0.0
    all_to_all_s: float = 0.0
    moe_rows_sent: int = 0
    moe_rows_received: int = 0
