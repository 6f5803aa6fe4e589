"""What crosses between Tandem's processes: requests to ranks, token streams, results and their
bills, rank and transfer ids, rank stats. Typed and frozen, and free of torch and the model, so
the frontend, the controller and the CLI import them without loading either.

::

    frontend ──RankRequest──▶ decode rank ──StreamBatch (TokenDelta.., RequestResult..)──▶ frontend
    CLI / group ──RankRequest──▶ colocated rank ──RequestResult (collect)──▶ CLI / group
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

from tandem.wire.logprobs import TokenLogprobs
from tandem.wire.request_params import FinishReason, SamplingParams


class Role(enum.StrEnum):
    PREFILL = "prefill"
    DECODE = "decode"
    COLOCATED = "colocated"  # prefill and decode on one rank, no transfer


@dataclass(frozen=True)
class ProcessPlace:
    """Where a process of the deployment runs: its Ray node and its process id, so that an
    operator can find, inspect or kill it."""

    node_id: str
    node_address: str
    labels: tuple[tuple[str, str], ...]  # the node's Ray labels, sorted
    pid: int


class RankId(NamedTuple):
    """One rank: its group and its place in it, ordered by both. A tuple, so hashing and
    comparing it (the router does, for every block it indexes or matches) costs what a tuple's
    does. ``name`` is the string the transport keys its peers by and logs show; it is made here
    and never parsed back."""

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
    # a request that moved here from a failed decode rank: the outputs its client already has;
    # it resumes after them (re-prefill of prompt + outputs) and streams from that index on
    resume_output_ids: tuple[int, ...] = ()
    # one choice of a request for several: the rank request id of another choice with the same
    # prompt on the same decode rank, whose prompt KV this one shares if that one is running
    # there (no prefill job, no transfer); otherwise it is prefilled as any request
    fork_of: str | None = None
    # mixed into the prompt's block chain on every rank (``engine/prefix_cache.py``
    # ``chain_root``): only requests with the same salt share cached pages; None: unsalted
    cache_salt: str | None = None


@dataclass(frozen=True)
class CachedByTier:
    """Cached prompt tokens by the tier they came from: the prefill rank's device pages, its
    host-memory pool, or the shared store. ``total`` is the bill's ``cached_tokens``."""

    device: int = 0
    host: int = 0
    store: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.store

    def plus(self, other: CachedByTier) -> CachedByTier:
        return CachedByTier(self.device + other.device, self.host + other.host, self.store + other.store)

    def as_dict(self) -> dict[str, int]:
        return {"device": self.device, "host": self.host, "store": self.store}


@dataclass(frozen=True)
class PrefillAttempt:
    """One attempt at a request's KV: a prefill job on a prefill rank and the transfer of its
    pages to the decode rank. A request has one per reservation: a retry after a failed
    transfer and a re-prefill after preemption are attempts of their own.

    Each figure is the difference of two readings of one process's monotonic clock. The decode
    rank's: ``kv_wait_s`` (prefill job sent -> notification seen, or the failure reported) and
    ``kv_accept_s`` (notification seen -> the KV is the request's and it decodes). The prefill
    rank's, carried by the notification: ``prefill_pickup_s`` (job received by the rank's actor
    -> queued on its loop), ``prefill_queue_s`` (queued -> first chunk scheduled),
    ``prefill_compute_s`` (first chunk scheduled -> last layer's KV in the pool),
    ``kv_transfer_s`` (first write posted -> last write completed, NIXL's completion) and
    ``kv_sender_exposed_s`` (last layer's KV in the pool -> notification sent). A failed attempt
    has only the decode rank's figures and bills no tokens or bytes.
    """

    attempt: int
    prefill_rank: RankId | None = None
    delivered: bool = False
    error: str | None = None
    prompt_tokens: int = 0  # tokens the prefill rank computed KV for (a re-prefill: prompt + outputs)
    cached_tokens: int = 0  # of those, found in its prefix cache (any tier)
    cached_by_tier: CachedByTier = field(default_factory=CachedByTier)  # cached_tokens by tier
    kv_bytes: int = 0  # the bytes the sender's write descriptors covered
    kv_wait_s: float = 0.0
    kv_accept_s: float = 0.0
    prefill_pickup_s: float = 0.0
    prefill_queue_s: float = 0.0
    prefill_compute_s: float = 0.0
    kv_transfer_s: float = 0.0
    kv_sender_exposed_s: float = 0.0

    @property
    def kv_transfer_exposed_s(self) -> float:
        """Last layer's KV computed -> KV usable on the decode rank: the part of the transfer
        that the prefill's compute did not hide. The sender's part plus the receiver's, each on
        its own clock; the notification's flight between them is in neither."""
        return self.kv_sender_exposed_s + self.kv_accept_s


@dataclass(frozen=True)
class Speculation:
    """Speculative decoding as measured, for one request or one rank: ``draft_tokens`` the
    drafter proposed, ``accepted_tokens`` of them that verification kept, and ``steps``, the
    decode steps (each verifies the drafts it was given, none included) that gave
    ``steps + accepted_tokens`` output tokens. ``acceptance_length``: tokens per step (1.0
    without speculation); the first output token, which prefill samples, is in none of these."""

    draft_tokens: int = 0
    accepted_tokens: int = 0
    steps: int = 0

    @property
    def acceptance_length(self) -> float:
        return (self.steps + self.accepted_tokens) / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def plus(self, drafts: int, accepted: int, steps: int = 1) -> Speculation:
        return Speculation(self.draft_tokens + drafts, self.accepted_tokens + accepted, self.steps + steps)


@dataclass(frozen=True)
class Bill:
    """What one request cost and where its time went, as its rank measured it: each duration is
    the difference of two readings of one process's monotonic clock, or a sum of such.

    On a decode rank, from the request's arrival there: ``pickup_s`` (actor received it -> on the
    loop), ``reservation_wait_s`` (on the loop, or preempted -> pages reserved and the prefill
    job sent; summed over reservations), ``decode_s`` (KV usable -> finished or preempted;
    summed), ``rank_s`` (arrival -> result), ``first_token_s`` and ``token_times_s`` (arrival ->
    each output token known). The KV figures are the sums over ``attempts``; ``cached_tokens``
    and ``new_prompt_tokens`` are too, so a retry or a re-prefill bills its tokens again.
    A colocated rank has no attempts: its cached tokens are its own prefix-cache hits.
    ``cached_tokens_by_tier`` splits ``cached_tokens`` by where they came from (their sum).
    """

    prompt_tokens: int = 0  # the request's prompt, as the client sent it
    cached_tokens: int = 0
    cached_tokens_by_tier: CachedByTier = field(default_factory=CachedByTier)
    new_prompt_tokens: int = 0
    output_tokens: int = 0
    preemptions: int = 0
    migrations: int = 0  # set by the frontend: decode ranks it moved away from (theirs failed)
    seed: int | None = None  # set by the frontend: the seed of every draw (the client's, or drawn)
    attempts: tuple[PrefillAttempt, ...] = ()
    speculation: Speculation = field(default_factory=Speculation)  # the decode rank's steps
    pickup_s: float = 0.0
    reservation_wait_s: float = 0.0
    decode_s: float = 0.0
    rank_s: float = 0.0
    first_token_s: float = 0.0
    token_times_s: tuple[float, ...] = ()

    def _total(self, name: str) -> float:
        return sum(getattr(a, name) for a in self.attempts)

    @property
    def kv_bytes(self) -> int:
        return sum(a.kv_bytes for a in self.attempts)

    @property
    def kv_wait_s(self) -> float:
        return self._total("kv_wait_s")

    @property
    def kv_accept_s(self) -> float:
        return self._total("kv_accept_s")

    @property
    def prefill_pickup_s(self) -> float:
        return self._total("prefill_pickup_s")

    @property
    def prefill_queue_s(self) -> float:
        return self._total("prefill_queue_s")

    @property
    def prefill_compute_s(self) -> float:
        return self._total("prefill_compute_s")

    @property
    def kv_transfer_s(self) -> float:
        return self._total("kv_transfer_s")

    @property
    def kv_transfer_exposed_s(self) -> float:
        return self._total("kv_transfer_exposed_s")


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
    # set when the rank failed, not the request (its loop raised, a collective of its group broke,
    # the group is going down): the frontend moves the request to another rank instead of ending it
    rank_failure: str | None = None
    # when asked for: each output token's (``None`` where none came: outputs resumed from another
    # rank), and each prompt position's (``None`` first)
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()


@dataclass(frozen=True)
class TokenDelta:
    """New output tokens of one request: indices ``start_index`` onwards, with the time each
    became known on the decode rank: ``times_s`` on its monotonic clock (gaps between tokens are
    differences of these), ``times_unix_s`` on its wall clock (for display)."""

    request_id: str
    start_index: int
    token_ids: tuple[int, ...]
    times_s: tuple[float, ...]
    times_unix_s: tuple[float, ...]
    logprobs: tuple[TokenLogprobs | None, ...] = ()  # one a token, when the request asked


@dataclass(frozen=True)
class StreamBatch:
    """What one decode rank pushes to one frontend after a loop iteration: the new tokens of its
    requests, in columns, and the results of those that ended.

    Delta ``i`` is request ``request_ids[i]``'s tokens from output index ``start_indices[i]``:
    ``token_ids[ends[i - 1]:ends[i]]`` (from 0 for the first), with ``times_s`` and
    ``times_unix_s`` of the same slice (as in :class:`TokenDelta`). A push of a large batch is a
    few flat tuples, not an object per token, on both sides of the wire. ``logprobs``, when a
    request of the batch asked for them, is a column of the same length (``None`` for the
    tokens of the others); else empty."""

    decode_rank: RankId
    request_ids: tuple[str, ...] = ()
    start_indices: tuple[int, ...] = ()
    ends: tuple[int, ...] = ()
    token_ids: tuple[int, ...] = ()
    times_s: tuple[float, ...] = ()
    times_unix_s: tuple[float, ...] = ()
    finished: tuple[RequestResult, ...] = ()
    logprobs: tuple[TokenLogprobs | None, ...] = ()
    # (request id, its prompt's logprobs), sent once, with the request's first tokens
    prompt_logprobs: tuple[tuple[str, tuple[TokenLogprobs | None, ...]], ...] = ()

    @classmethod
    def of(
        cls,
        decode_rank: RankId,
        deltas: tuple[TokenDelta, ...] = (),
        finished: tuple[RequestResult, ...] = (),
    ) -> StreamBatch:
        columns = StreamColumns()
        for d in deltas:
            columns.add(d.request_id, d.start_index, d.token_ids, d.times_s, d.times_unix_s, d.logprobs)
        return columns.batch(decode_rank, finished)

    @property
    def deltas(self) -> tuple[TokenDelta, ...]:
        """The deltas as objects (for inspection; the frontend reads the columns)."""
        out, begin = [], 0
        for request_id, start, end in zip(self.request_ids, self.start_indices, self.ends, strict=True):
            out.append(
                TokenDelta(
                    request_id,
                    start,
                    self.token_ids[begin:end],
                    self.times_s[begin:end],
                    self.times_unix_s[begin:end],
                    self.logprobs[begin:end] if any(e is not None for e in self.logprobs[begin:end]) else (),
                )
            )
            begin = end
        return tuple(out)


class StreamColumns:
    """A :class:`StreamBatch`'s deltas as a decode rank collects them over a loop iteration."""

    __slots__ = (
        "ends",
        "logprobs",
        "prompt_logprobs",
        "request_ids",
        "start_indices",
        "times_s",
        "times_unix_s",
        "token_ids",
    )

    def __init__(self) -> None:
        self.request_ids: list[str] = []
        self.start_indices: list[int] = []
        self.ends: list[int] = []
        self.token_ids: list[int] = []
        self.times_s: list[float] = []
        self.times_unix_s: list[float] = []
        self.logprobs: list[TokenLogprobs | None] | None = None  # once a request brings them
        self.prompt_logprobs: list[tuple[str, tuple[TokenLogprobs | None, ...]]] = []

    def add(
        self,
        request_id: str,
        start_index: int,
        token_ids: Sequence[int],
        times_s: Sequence[float],
        times_unix_s: Sequence[float],
        logprobs: Sequence[TokenLogprobs | None] = (),
    ) -> None:
        """``logprobs``: one a token, or none (the request did not ask)."""
        if logprobs and len(logprobs) != len(token_ids):
            raise ValueError(f"request {request_id}: {len(token_ids)} tokens with {len(logprobs)} logprobs")
        if logprobs and self.logprobs is None:
            self.logprobs = [None] * len(self.token_ids)
        if self.logprobs is not None:
            self.logprobs += logprobs or [None] * len(token_ids)
        if not len(token_ids) == len(times_s) == len(times_unix_s):
            raise ValueError(
                f"request {request_id}: {len(token_ids)} tokens with {len(times_s)} and "
                f"{len(times_unix_s)} times"
            )
        self.request_ids.append(request_id)
        self.start_indices.append(start_index)
        self.token_ids += token_ids
        self.times_s += times_s
        self.times_unix_s += times_unix_s
        self.ends.append(len(self.token_ids))

    def batch(self, decode_rank: RankId, finished: tuple[RequestResult, ...] = ()) -> StreamBatch:
        return StreamBatch(
            decode_rank,
            tuple(self.request_ids),
            tuple(self.start_indices),
            tuple(self.ends),
            tuple(self.token_ids),
            tuple(self.times_s),
            tuple(self.times_unix_s),
            finished,
            tuple(self.logprobs) if self.logprobs is not None else (),
            tuple(self.prompt_logprobs),
        )


@dataclass(frozen=True)
class LoopStats:
    """The step loop's own counters (every role)."""

    steps: int = 0
    idle_waits: int = 0
    agree_s: float = 0.0  # in the one-integer all-reduce that decides whether to step
    step_s: float = 0.0
    idle_s: float = 0.0  # waiting for a call with nothing to compute
    tick_s: float = 0.0  # the queued calls and ``tick`` (transport poll, deadlines, reservations)
    publish_s: float = 0.0  # results handed over and pushes sent (tokens to frontends, events)


@dataclass(frozen=True)
class StepSplit:
    """Where a rank's steps went since start, each piece timed around itself on the rank's
    ``perf_counter``: ``schedule`` (the plan), ``prepare`` (input and attention-metadata tensors),
    ``forward`` (the model), ``sample`` (logits and sampling), ``update`` (sampled tokens into
    their requests, stream deltas built), ``draft`` (speculative decoding's drafter)."""

    schedule_s: float = 0.0
    prepare_s: float = 0.0
    forward_s: float = 0.0
    sample_s: float = 0.0
    update_s: float = 0.0
    draft_s: float = 0.0


@dataclass(frozen=True)
class TierStats:
    """A rank's KV tiers below its device pages, since start: what it loaded from each (bytes
    and the seconds the copies took, on its own clock), what it wrote to the store, the store's
    failures (``store_errors``: calls that failed or timed out; ``store_rejected``: blocks read
    that failed their check: corrupt, truncated, another model or layout; ``store_slow``: fetches
    not answered within recomputing's price, misses that back the store off), the cached tokens
    it chose to compute again because loading them was priced slower, and its measured prices
    (bytes/s from each tier, prefill tokens/s; 0 until measured). Host pages: the pool's size
    and how many hold a block."""

    host_pages_total: int = 0
    host_pages_used: int = 0
    host_load_bytes: int = 0
    host_load_s: float = 0.0
    store_load_bytes: int = 0
    store_load_s: float = 0.0
    store_write_bytes: int = 0
    store_write_s: float = 0.0
    store_writes: int = 0
    store_errors: int = 0
    store_rejected: int = 0
    store_slow: int = 0
    recomputed_tokens: int = 0
    host_bytes_per_s: float = 0.0
    store_bytes_per_s: float = 0.0
    prefill_tokens_per_s: float = 0.0
    kv_bytes_per_token: int = 0  # of the rank's pool, every layer: what a loaded token moves


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
    pending_tokens: int = 0  # a prefill rank's prompt tokens still to compute (queued or computing)
    running: int = 0
    waiting_for_kv: int = 0
    computing: int = 0
    transferring: int = 0
    free_pages: int = 0
    total_pages: int = 0
    cached_pages: int = 0
    kv_bytes_sent: int = 0
    kv_bytes_received: int = 0
    sends_in_flight: int = 0
    receives_in_flight: int = 0
    peers_connected: int = 0  # ranks of the other role its KV transport has reached
    prefix_queried_tokens: int = 0  # prompt tokens looked up in the prefix cache, since start
    prefix_hit_tokens: int = 0  # of those, found there
    preemptions: int = 0
    speculation: Speculation = field(default_factory=Speculation)  # a decode rank's, since start
    # failed transfers since start, by direction ("send"/"recv") and cause (the error's kind)
    transfer_failures: tuple[tuple[str, str, int], ...] = ()
    local_experts: int = 0
    weight_bytes: int = 0  # the model's weights resident on the rank's device (FP8: 1 byte each)
    forward_s: float = 0.0
    all_to_all_s: float = 0.0
    moe_rows_sent: int = 0
    moe_rows_received: int = 0
    split: StepSplit = field(default_factory=StepSplit)
    tiers: TierStats = field(default_factory=TierStats)  # a prefill, colocated or writing-back rank's
