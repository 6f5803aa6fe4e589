"""One request a decode rank holds, as one record from its arrival to its end.

The decode scheduler owns the records (``DecodeScheduler.record``): where a request is lives in
``request.status`` and its pages in ``request.page_ids``; the record adds its reservation and
transfer (``attempt``, ``deadline_s``, ``transfer``: the attempt's id, ``prefill_rank``), its
stream position (``streamed``: outputs its frontend has), and the readings of the rank's
monotonic clock its bill is made of: received at ``received_at``, queued since ``queued_at``,
waiting for KV since ``expect_at``, running since ``running_at``. The scheduler moves the first
part, the worker (``decode/worker.py``) the rest; neither keeps another record of a request.
Torch-free.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.engine.admission import request_of
from tandem.engine.bill_builder import build_bill, delivered_cached_by_tier, delivered_prompt_tokens
from tandem.engine.request import Request
from tandem.kvtransfer.types import KVDestination, KVNotification
from tandem.wire.logprobs import TokenLogprobs
from tandem.wire.messages import (
    Bill,
    CachedByTier,
    PrefillAttempt,
    RankId,
    RankRequest,
    RequestResult,
    Speculation,
    TransferId,
)
from tandem.wire.prefill_job import PrefillJob
from tandem.wire.request_params import FinishReason

if TYPE_CHECKING:
    from tandem.model.family import AnyConfig

# outputs a frontend has not had: the first one's index, their ids, when each was known (the rank's
# monotonic clock), their logprobs, and the prompt's logprobs (with the first outputs only)
StreamDelta = tuple[
    int, tuple[int, ...], tuple[float, ...], Sequence[TokenLogprobs | None], Sequence[TokenLogprobs | None]
]


@dataclass(frozen=True)
class Routing:
    """Where a request came from and the prefill rank its router chose."""

    prefill_rank: RankId | None = None
    frontend: str | None = None
    fork_of: str | None = None  # the request whose prompt KV it may share (``RankRequest.fork_of``)


def admitted(
    items: Sequence[RankRequest], cfg: AnyConfig, page_size: int, num_pages: int, received: float
) -> list[tuple[Request, Routing, float]]:
    """Requests built and checked against a decode rank's limits (``admission.request_of``), with
    where each came from, received at ``received``: one that could never run fails here."""
    eos, limit = frozenset(cfg.eos_token_ids), cfg.max_position_embeddings
    out = []
    for r in items:
        request = request_of(r, cfg.vocab_size, eos, limit, page_size, num_pages)
        fork_of = r.fork_of if not r.resume_output_ids else None
        out.append((request, Routing(r.prefill_rank, r.frontend, fork_of), received))
    return out


@dataclass(eq=False)
class DecodeRequest:
    """One request on a decode rank (compared by identity)."""

    request: Request
    order: int = -1  # the scheduler's arrival number: the running batch is kept in this order
    # -- its reservation and the transfer into it (the scheduler's) --
    attempt: int = -1  # number of the latest reservation
    num_reserved_tokens: int = 0  # tokens the current reservation's prefill writes
    deadline_s: float = math.inf
    kv_retries: int = 0
    aborting: bool = False  # aborted while WAITING_FOR_KV: finishes as "abort" when the transfer ends
    expiry_reported: bool = False
    num_drafts: int = 0  # draft room of the step scheduled and not yet updated: its pages are held
    forked: bool = False  # running on its parent's prompt pages, its first token not yet drawn
    # -- where it came from, where its KV comes from, what its client has (the worker's) --
    routing: Routing = field(default_factory=Routing)
    transfer: TransferId | None = None  # the current attempt's transfer
    prefill_rank: RankId | None = None  # the current attempt's prefill rank
    job_tokens: int = 0  # tokens the current attempt's prefill job carries
    streamed: int = 0  # output tokens already pushed to the frontend
    guide_pending: bool = False  # guided, its grammar not known to be ready (``guide_wait``)
    guide_error: str | None = None  # its grammar did not compile here: it ends once running
    ended: bool = False  # its result is reported (the rank failed with it held)
    # -- its bill: readings of the rank's monotonic clock and what they add up to --
    received_at: float = 0.0  # received by the rank's actor
    queued_at: float | None = None
    expect_at: float = 0.0
    running_at: float | None = None
    pickup_s: float = 0.0
    reservation_wait_s: float = 0.0
    decode_s: float = 0.0
    preemptions: int = 0
    attempts: list[PrefillAttempt] = field(default_factory=list)
    token_at: list[float] = field(default_factory=list)  # when each output token was known
    speculation: Speculation = field(default_factory=Speculation)

    @property
    def request_id(self) -> str:
        return self.request.request_id

    def received(self, routing: Routing, received_at: float, now: float) -> None:
        """It reached the rank's actor at ``received_at`` and its loop at ``now``; a resumed one
        (moved from a failed decode rank) has outputs its client has already."""
        self.routing, self.received_at = routing, received_at
        self.queued_at, self.pickup_s = now, now - received_at
        self.streamed = len(self.request.output_token_ids)
        self.token_at = [received_at] * self.streamed

    def job_sent(self, transfer: TransferId, prefill_rank: RankId, num_tokens: int, now: float) -> None:
        """Its prefill job of ``num_tokens`` tokens went to ``prefill_rank`` at ``now``: the
        reservation's wait ends, the KV's begins."""
        if self.queued_at is not None:
            self.reservation_wait_s += now - self.queued_at
            self.queued_at = None
        self.transfer, self.prefill_rank, self.expect_at = transfer, prefill_rank, now
        self.job_tokens = num_tokens

    def prefill_job(self, destination: KVDestination, timeout_s: float) -> PrefillJob:
        """The job of its current attempt (``job_sent``): its first ``job_tokens`` tokens,
        written into ``destination`` (its reserved pages) within ``timeout_s``."""
        assert self.transfer is not None
        request = self.request
        return PrefillJob(
            request_id=self.transfer.key,
            prompt_token_ids=tuple(request.all_token_ids[: self.job_tokens]),
            sampling=request.sampling,
            output_index=len(request.output_token_ids),
            destination=destination,
            deadline_s=time.time() + timeout_s,
            cache_salt=request.cache_salt,
        )

    def kv_delivered(self, n: KVNotification, seen: float, usable: float) -> PrefillAttempt:
        """The current attempt's KV arrived (notified at ``seen``, the request's own at
        ``usable``): the attempt as its bill shows it; it runs from ``usable``."""
        assert self.transfer is not None
        t = n.timings
        attempt = PrefillAttempt(
            attempt=self.transfer.attempt,
            prefill_rank=self.prefill_rank,
            delivered=True,
            prompt_tokens=self.job_tokens,
            cached_tokens=n.cached_tokens,
            cached_by_tier=CachedByTier(n.cached_device_tokens, n.cached_host_tokens, n.cached_store_tokens),
            kv_bytes=n.kv_bytes,
            kv_wait_s=seen - self.expect_at,
            kv_accept_s=usable - seen,
            prefill_pickup_s=t.prefill_pickup_s,
            prefill_queue_s=t.prefill_queue_s,
            prefill_compute_s=t.prefill_compute_s,
            kv_transfer_s=t.kv_transfer_s,
            kv_sender_exposed_s=t.kv_sender_exposed_s,
        )
        self.attempts.append(attempt)
        self.running_at = usable
        if not self.token_at:
            self.token_at.append(usable)
        return attempt

    def kv_lost(self, error: str, now: float) -> None:
        """The current attempt's transfer failed at ``now``; a retry waits for its next
        reservation from then."""
        assert self.transfer is not None
        self.attempts.append(
            PrefillAttempt(
                attempt=self.transfer.attempt,
                prefill_rank=self.prefill_rank,
                error=error,
                kv_wait_s=now - self.expect_at,
            )
        )
        self.queued_at = now

    def fork_started(self, now: float) -> None:
        """It runs from ``now`` on its parent's prompt KV: one attempt, every prompt token but the
        last cached on this rank's device, no transfer."""
        request, shared = self.request, self.request.num_prompt_tokens - 1
        request.num_cached_tokens = shared
        self.attempts.append(
            PrefillAttempt(
                attempt=0,
                delivered=True,
                prompt_tokens=request.num_prompt_tokens,
                cached_tokens=shared,
                cached_by_tier=CachedByTier(device=shared),
            )
        )
        self.running_at = now

    def stepped(self, now: float, drafts: int, given: int) -> int:
        """A decode step gave it ``given`` tokens at ``now`` (known together) from ``drafts``
        drafts; how many of those were accepted (its bill counts both)."""
        accepted = min(given - 1, drafts)
        self.token_at.extend([now] * given)
        self.speculation = self.speculation.plus(drafts, accepted)
        return accepted

    def preempted(self, now: float) -> None:
        self.stop_running(now)
        self.queued_at, self.preemptions = now, self.preemptions + 1

    def new_tokens(self) -> StreamDelta | None:
        """The outputs its frontend has not had: (their first index, the ids, when each was known,
        their logprobs, the prompt's logprobs with the first of them), and they count as
        streamed; ``None`` when there are none or no frontend streams it."""
        request, streamed = self.request, self.streamed
        outputs = request.output_token_ids
        if self.routing.frontend is None or len(outputs) <= streamed:
            return None
        new = tuple(outputs[streamed:])
        known = self.token_at[streamed : len(outputs)]
        at = tuple(known) + (time.monotonic(),) * (len(new) - len(known))
        logprobs = request.output_logprobs_from(streamed)
        wanted = request.sampling.prompt_logprobs is not None and streamed == 0
        prompt = request.prompt_logprobs if wanted else ()
        self.streamed = len(outputs)
        return streamed, new, at, logprobs, prompt

    def result(
        self, request: Request | None, rank: RankId, reason: FinishReason, error: str | None
    ) -> RequestResult:
        """Its result, bill and logprobs included; ``request`` ``None``: refused before it was
        queued (no tokens, no prompt)."""
        tokens = tuple(request.output_token_ids) if request is not None else ()
        bill = self.bill(request, time.monotonic())
        result = RequestResult(self.request_id, tokens, reason, bill, rank, self.prefill_rank, error)
        if request is None:
            return result
        sampling = request.sampling
        if sampling.logprobs is None and sampling.prompt_logprobs is None:
            return result
        prompt = tuple(request.prompt_logprobs) if sampling.prompt_logprobs is not None else ()
        logprobs = tuple(request.output_logprobs_from(0))
        return dataclasses.replace(result, logprobs=logprobs, prompt_logprobs=prompt)

    def stop_running(self, now: float) -> None:
        if self.running_at is not None:
            self.decode_s += now - self.running_at
            self.running_at = None

    def bill(self, request: Request | None, now: float) -> Bill:
        """Its bill at ``now``; ``request`` ``None``: refused before it was queued."""
        self.stop_running(now)
        cached, new = delivered_prompt_tokens(self.attempts)
        return build_bill(
            cached_by_tier=delivered_cached_by_tier(self.attempts),
            prompt_tokens=request.num_prompt_tokens if request else 0,
            cached_tokens=cached,
            new_prompt_tokens=new,
            output_tokens=len(request.output_token_ids) if request else 0,
            preemptions=self.preemptions,
            attempts=self.attempts,
            arrival=self.received_at,
            token_at=self.token_at,
            now=now,
            pickup_s=self.pickup_s,
            decode_s=self.decode_s,
            reservation_wait_s=self.reservation_wait_s,
            speculation=self.speculation,
        )
