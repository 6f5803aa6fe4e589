"""One streamed request at the frontend: token deltas from its decode rank in, chunks out.

Deltas carry output indices, so a late or repeated delta is put in order or dropped; a chunk
holds the longest run of new tokens from the next expected index, with the text they complete
and per-token timings (the gap of token 0 is measured from the frontend arrival). The result
that ends the request is authoritative: tokens it holds that no delta brought are streamed
before the summary, stamped with the time the result arrived.

::

    push_stream(StreamBatch) -> on_delta(TokenDelta) -> StreamChunk  --\\
                                on_result(RequestResult) -> StreamChunk? + StreamSummary -> queue -> gRPC
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace

from tandem.engine.messages import Bill, RankId, RequestResult, TokenDelta
from tandem.engine.request import FinishReason
from tandem.model.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass(frozen=True)
class TokenTiming:
    index: int
    server_time_s: float  # Unix seconds
    gap_s: float


@dataclass(frozen=True)
class StreamChunk:
    token_ids: list[int]
    text: str
    timings: list[TokenTiming]


@dataclass(frozen=True)
class Route:
    """Where the frontend sent the request and why."""

    prefill_rank: RankId
    decode_rank: RankId
    predicted_cached_tokens: int
    branch: str
    queue_s: float
    routing_s: float


@dataclass(frozen=True)
class StreamSummary:
    finish_reason: FinishReason
    error: str | None
    token_ids: list[int]
    text: str
    bill: Bill
    route: Route | None
    prefill_rank: RankId | None  # where the KV was computed (a retry may differ from the route)
    decode_rank: RankId | None
    ttft_s: float  # from the frontend arrival
    e2e_s: float


@dataclass
class RequestStream:
    request_id: str
    prompt_tokens: int
    tokenizer: Tokenizer
    arrival_unix_s: float = field(default_factory=time.time)
    route: Route | None = None
    queue: asyncio.Queue[StreamChunk | StreamSummary] = field(default_factory=asyncio.Queue)
    finished: bool = False
    _next_index: int = 0
    _pending: dict[int, tuple[int, float]] = field(default_factory=dict)  # index -> (token, time)
    _tokens: list[int] = field(default_factory=list)
    _last_time_s: float = 0.0
    _first_token_unix_s: float | None = None
    _detokenizer: IncrementalDetokenizer | None = None

    def __post_init__(self) -> None:
        self._detokenizer = IncrementalDetokenizer(self.tokenizer)
        self._last_time_s = self.arrival_unix_s

    def on_delta(self, delta: TokenDelta) -> StreamChunk | None:
        """Queue the chunk ``delta`` completes (``None`` when it completes nothing)."""
        if self.finished:
            return None
        for offset, (token, at) in enumerate(zip(delta.token_ids, delta.times_unix_s, strict=True)):
            index = delta.start_index + offset
            if index >= self._next_index:
                self._pending.setdefault(index, (token, at))
        chunk = self._drain()
        if chunk is not None:
            self.queue.put_nowait(chunk)
        return chunk

    def on_result(self, result: RequestResult) -> StreamSummary:
        """End the stream with ``result``: any tokens not streamed yet, then the summary."""
        now = time.time()
        bill = result.bill
        if bill.prompt_tokens == 0:  # ended before its rank counted it (a failed group)
            bill = replace(bill, prompt_tokens=self.prompt_tokens)
        for index in range(self._next_index, len(result.token_ids)):
            self._pending.setdefault(index, (result.token_ids[index], now))
        chunk = self._drain()
        if chunk is not None:
            self.queue.put_nowait(chunk)
        assert self._detokenizer is not None
        tail = self._detokenizer.finish()
        if tail:
            self.queue.put_nowait(StreamChunk([], tail, []))
        first = self._first_token_unix_s
        summary = StreamSummary(
            finish_reason=result.finish_reason,
            error=result.error,
            token_ids=list(self._tokens),
            text=self.tokenizer.decode(self._tokens),
            bill=bill,
            route=self.route,
            prefill_rank=result.prefill_rank,
            decode_rank=result.decode_rank,
            # the decode rank's clock against the frontend's: never below zero
            ttft_s=max(first - self.arrival_unix_s, 0.0) if first is not None else 0.0,
            e2e_s=now - self.arrival_unix_s,
        )
        self.finished = True
        self.queue.put_nowait(summary)
        return summary

    def fail(self, reason: str, decode_rank: RankId | None = None) -> StreamSummary:
        """End the stream with an error the ranks did not report (e.g. its rank is gone)."""
        bill = Bill(prompt_tokens=self.prompt_tokens)
        tokens = tuple(self._tokens)
        return self.on_result(
            RequestResult(self.request_id, tokens, FinishReason.ERROR, bill, decode_rank, error=reason)
        )

    def _drain(self) -> StreamChunk | None:
        assert self._detokenizer is not None
        tokens: list[int] = []
        timings: list[TokenTiming] = []
        text = []
        while self._next_index in self._pending:
            token, at = self._pending.pop(self._next_index)
            if self._first_token_unix_s is None:
                self._first_token_unix_s = at
            timings.append(TokenTiming(self._next_index, at, max(at - self._last_time_s, 0.0)))
            self._last_time_s = at
            tokens.append(token)
            text.append(self._detokenizer.add(token))
            self._next_index += 1
        if not tokens:
            return None
        self._tokens.extend(tokens)
        return StreamChunk(tokens, "".join(text), timings)
