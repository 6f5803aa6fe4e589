"""What the router has sent to each rank and not yet seen finish.

Prefill load is the number of *new* tokens routed to a rank whose prefill is not done: the prompt
minus what its predicted cached prefix saves (a block loaded from the host tier or the store
counts at its load price, ``PrefillCandidate.saved_blocks``). Decode load combines what this
router routed with what the rank last reported::

    request  ──route──▶ prefill tokens + decode request + promised pages
             ──prefill_done──▶ prefill tokens dropped (pages stay promised)
             ──stats report of its decode rank──▶ promise dropped (the report counts the pages)
             ──finished / abort──▶ everything dropped

A promise lasts until the first report that arrives after the request's prefill is done: the
decode rank reserves a request's pages before it dispatches the prefill, so such a report
includes them, while an earlier one may not.

Invariant (``check_integrity``): each per-rank total equals the sum over the requests that
count against it, and no total is negative.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Generic

from tandem.router.rank_key import K


class LoadIntegrityError(AssertionError):
    """Per-rank totals disagree with the requests in flight: a bug in the tracker."""


@dataclass(frozen=True)
class DecodeStats:
    """The latest report of one decode rank."""

    free_pages: int
    running: int
    total_pages: int


@dataclass
class _InFlight(Generic[K]):
    prefill_rank: K | None  # None once the prefill is done (or its rank left)
    new_tokens: int
    decode_rank: K | None  # None once its decode rank left
    promised_pages: int  # 0 once a report counts them


class LoadTracker(Generic[K]):
    """In-flight work per prefill and decode rank. All operations on a request id that is not
    in flight are no-ops, so completion signals may repeat or race with an abort."""

    def __init__(self) -> None:
        self._requests: dict[str, _InFlight[K]] = {}
        self._prefill_tokens: dict[K, int] = {}
        self._routed_tokens: dict[K, int] = {}  # since the rank joined, done or not
        self._decode_requests: dict[K, int] = {}
        self._promised_pages: dict[K, int] = {}
        self._stats: dict[K, DecodeStats] = {}
        self._reported_tokens: dict[K, int] = {}  # each prefill rank's own count of pending tokens
        # per decode rank: requests whose prefill is done and whose pages are still promised
        self._awaiting_report: dict[K, set[str]] = {}

    def set_ranks(self, prefill: Iterable[K], decode: Iterable[K]) -> None:
        """Track exactly these ranks. Work routed to a rank that left stops counting anywhere
        (the request itself stays in flight for its other rank)."""
        prefill_set, decode_set = set(prefill), set(decode)
        for rank in set(self._prefill_tokens) - prefill_set:
            del self._prefill_tokens[rank], self._routed_tokens[rank]
            self._reported_tokens.pop(rank, None)
        for rank in set(self._decode_requests) - decode_set:
            del self._decode_requests[rank], self._promised_pages[rank], self._awaiting_report[rank]
            self._stats.pop(rank, None)
        for rank in prefill_set:
            self._prefill_tokens.setdefault(rank, 0)
            self._routed_tokens.setdefault(rank, 0)
        for rank in decode_set:
            self._decode_requests.setdefault(rank, 0)
            self._promised_pages.setdefault(rank, 0)
            self._awaiting_report.setdefault(rank, set())
        for request_id, entry in list(self._requests.items()):
            if entry.prefill_rank is not None and entry.prefill_rank not in prefill_set:
                entry.prefill_rank = None
            if entry.decode_rank is not None and entry.decode_rank not in decode_set:
                entry.decode_rank, entry.promised_pages = None, 0
            if entry.prefill_rank is None and entry.decode_rank is None:
                del self._requests[request_id]

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._requests

    def add(self, request_id: str, prefill_rank: K, new_tokens: int, decode_rank: K, pages: int) -> None:
        """Count a routed request against both of its ranks (both must be tracked)."""
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} is already in flight")
        if new_tokens < 0 or pages < 0:
            raise ValueError(f"negative load: {new_tokens} tokens, {pages} pages")
        self._requests[request_id] = _InFlight(prefill_rank, new_tokens, decode_rank, pages)
        self._prefill_tokens[prefill_rank] += new_tokens
        self._routed_tokens[prefill_rank] += new_tokens
        self._decode_requests[decode_rank] += 1
        self._promised_pages[decode_rank] += pages

    def prefill_done(self, request_id: str) -> None:
        entry = self._requests.get(request_id)
        if entry is None or entry.prefill_rank is None:
            return
        self._prefill_tokens[entry.prefill_rank] -= entry.new_tokens
        entry.prefill_rank = None
        if entry.decode_rank is not None and entry.promised_pages:
            self._awaiting_report[entry.decode_rank].add(request_id)

    def finish(self, request_id: str) -> None:
        """The request finished or was aborted: drop all it still counts for."""
        self.prefill_done(request_id)
        entry = self._requests.pop(request_id, None)
        if entry is None or entry.decode_rank is None:
            return
        self._decode_requests[entry.decode_rank] -= 1
        self._promised_pages[entry.decode_rank] -= entry.promised_pages
        self._awaiting_report[entry.decode_rank].discard(request_id)

    def update_decode_stats(self, rank: K, free_pages: int, running: int, total_pages: int) -> None:
        """Record a decode rank's report; it now counts the pages of every request routed there
        whose prefill is done. Reports of untracked ranks are ignored (it may have just left)."""
        if min(free_pages, running, total_pages) < 0 or free_pages > total_pages:
            raise ValueError(f"bad stats from {rank}: {free_pages=} {running=} {total_pages=}")
        if rank not in self._decode_requests:
            return
        self._stats[rank] = DecodeStats(free_pages, running, total_pages)
        for request_id in self._awaiting_report[rank]:
            entry = self._requests[request_id]
            self._promised_pages[rank] -= entry.promised_pages
            entry.promised_pages = 0
        self._awaiting_report[rank].clear()

    def update_prefill_stats(self, rank: K, pending_tokens: int) -> None:
        """Record a prefill rank's report of the tokens it has still to compute: with several
        frontends it counts the others' requests, which this router never saw."""
        if pending_tokens < 0:
            raise ValueError(f"bad stats from {rank}: {pending_tokens=}")
        if rank in self._prefill_tokens:
            self._reported_tokens[rank] = pending_tokens

    def prefill_tokens(self, rank: K) -> int:
        return self._prefill_tokens.get(rank, 0)

    def prefill_load(self, rank: K) -> int:
        """The rank's load for routing: the larger of what this router has in flight there and
        what the rank last reported (which includes other frontends' requests, but lags)."""
        return max(self._prefill_tokens.get(rank, 0), self._reported_tokens.get(rank, 0))

    def routed_tokens(self, rank: K) -> int:
        return self._routed_tokens.get(rank, 0)

    def prefill_loads(self) -> dict[K, int]:
        return dict(self._prefill_tokens)

    def decode_requests(self, rank: K) -> int:
        return self._decode_requests.get(rank, 0)

    def decode_loads(self) -> dict[K, int]:
        return dict(self._decode_requests)

    def promised_pages(self, rank: K) -> int:
        return self._promised_pages.get(rank, 0)

    def decode_stats(self, rank: K) -> DecodeStats | None:
        """The rank's latest report, or ``None`` before its first."""
        return self._stats.get(rank)

    @property
    def num_in_flight(self) -> int:
        return len(self._requests)

    def check_integrity(self) -> None:
        """Raise ``LoadIntegrityError`` unless the per-rank totals match the requests."""
        tokens = dict.fromkeys(self._prefill_tokens, 0)
        requests = dict.fromkeys(self._decode_requests, 0)
        pages = dict.fromkeys(self._promised_pages, 0)
        for request_id, entry in self._requests.items():
            if entry.prefill_rank is None and entry.decode_rank is None:
                raise LoadIntegrityError(f"request {request_id!r} counts against no rank")
            if entry.prefill_rank is not None:
                if entry.prefill_rank not in tokens:
                    raise LoadIntegrityError(f"{request_id!r} counts on untracked {entry.prefill_rank}")
                tokens[entry.prefill_rank] += entry.new_tokens
            if entry.decode_rank is not None:
                if entry.decode_rank not in requests:
                    raise LoadIntegrityError(f"{request_id!r} counts on untracked {entry.decode_rank}")
                requests[entry.decode_rank] += 1
                pages[entry.decode_rank] += entry.promised_pages
        for name, expected, actual in (
            ("prefill tokens", tokens, self._prefill_tokens),
            ("decode requests", requests, self._decode_requests),
            ("promised pages", pages, self._promised_pages),
        ):
            if expected != actual:
                raise LoadIntegrityError(f"{name}: totals {actual} but requests sum to {expected}")
            negative = [rank for rank, value in actual.items() if value < 0]
            if negative:
                raise LoadIntegrityError(f"{name} negative on {negative}")
        if set(self._stats) - set(self._decode_requests):
            raise LoadIntegrityError("stats kept for an untracked decode rank")
        for rank, waiting in self._awaiting_report.items():
            for request_id in waiting:
                waiter = self._requests.get(request_id)
                if waiter is None or waiter.decode_rank != rank or waiter.prefill_rank is not None:
                    raise LoadIntegrityError(f"{request_id!r} awaits a report of {rank} but should not")
