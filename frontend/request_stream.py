"""One streamed request at the frontend: token deltas from its decode rank in, chunks out.

Deltas carry output indices, so a late or repeated delta is put in order or dropped; a chunk
holds the longest run of new tokens from the next expected index, with the text they complete
and per-token timings. The result that ends the request is authoritative: tokens it holds that
no delta brought are streamed before the summary.

Times: the frontend's own figures (queue, routing, time to first token, end to end) are
differences of readings of this process's monotonic clock (``clock``), from the request's
arrival here. The gap between two tokens is the difference of the decode rank's readings of its
own clock (a request's tokens all come from one decode rank); the gap of token 0 is the time to
first token. No figure subtracts one process's clock from another's.

Backpressure: the stream holds one chunk for its client (:class:`ChunkBuffer`); tokens that
come before the client takes it join it, so a slow reader gets fewer, larger messages and the
memory held is bounded by the request's tokens (its ``max_tokens``), never by the number of
decode steps.

::

    a StreamBatch on a rank channel -> on_delta(TokenDelta) -> tokens, text, timings --\\
                                       on_result(RequestResult) -> tokens? + StreamSummary -> buffer -> gRPC
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from tandem.frontend.detokenizer import PairCache, StreamDetokenizer
from tandem.model.tokenizer import Tokenizer
from tandem.wire.logprobs import TokenLogprobs
from tandem.wire.messages import Bill, RankId, RequestResult, TokenDelta
from tandem.wire.request_params import FinishReason
from tandem.wire.stream_summary import Route, StreamSummary


@dataclass(frozen=True, slots=True)
class TokenTiming:
    """One token's timing, as :attr:`StreamChunk.timings` gives it (a chunk keeps columns)."""

    index: int
    server_time_s: float  # Unix seconds, the decode rank's wall clock (for display)
    gap_s: float  # since the previous token on the decode rank; token 0: time to first token


@dataclass(slots=True)  # one or more a step per stream: not frozen, which makes it cheaper to make
class StreamChunk:
    """Consecutive output tokens from ``first_index`` on, the text they complete, and each
    token's timing in columns (no object a token; :attr:`timings` makes them)."""

    token_ids: list[int]
    text: str
    first_index: int = 0
    server_times_s: list[float] = field(default_factory=list)  # Unix seconds, the decode rank's
    gaps_s: list[float] = field(default_factory=list)  # since the previous token on the rank
    # set as the chunk leaves its stream, when the request asked: one a token, and on the first
    # chunk the prompt's (``RequestStream.logprobs``)
    logprobs: list[TokenLogprobs | None] | None = None
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()

    @property
    def timings(self) -> list[TokenTiming]:
        return [
            TokenTiming(index, server, gap)
            for index, server, gap in zip(
                range(self.first_index, self.first_index + len(self.gaps_s)),
                self.server_times_s,
                self.gaps_s,
                strict=True,
            )
        ]


class ChunkBuffer:
    """A stream's output waiting for its client: at most one chunk, then the summary. With
    ``interval`` above 1, a chunk goes once it holds that many tokens (the first chunk and the
    summary go at once; the summary takes what a chunk held before it).

    Tokens that come before the client has taken the chunk held join it (in place, so a token
    costs three appends, not a chunk of its own), and the client gets every token since its last
    read in one message: a client that reads slower than its tokens come (or stops reading, and
    HTTP/2 flow control holds the server's writes) gets fewer, larger messages, and the memory
    held is bounded by the request's tokens (its ``max_tokens``), never by the number of decode
    steps. One producer (the frontend's event loop, on each push), one consumer (the request's
    generator), which waits on a future of its own while the buffer is empty."""

    def __init__(self, interval: int = 1) -> None:
        if interval < 1:
            raise ValueError(f"interval: must be at least 1, got {interval}")
        self.interval = interval  # tokens held before the consumer is woken (the first: at once)
        self._first = True
        self._chunk: StreamChunk | None = None
        self._texts: list[str] = []  # the held chunk's text, joined when it is taken
        self._summary: StreamSummary | None = None
        self._waiter: asyncio.Future[None] | None = None

    def __len__(self) -> int:
        return (self._chunk is not None) + (self._summary is not None)

    @property
    def tokens(self) -> int:
        """Token ids held."""
        return 0 if self._chunk is None else len(self._chunk.token_ids)

    def empty(self) -> bool:
        return self._chunk is None and self._summary is None

    def add(self, index: int, token: int, text: str, server_time_s: float, gap_s: float) -> None:
        """Output token ``index`` (the one after the held chunk's last), the text it completes
        and its timing, at the end of the held chunk."""
        chunk = self._chunk
        if chunk is None:
            chunk = self._open(index)
        ids = chunk.token_ids
        ids.append(token)
        if text:
            self._texts.append(text)
        chunk.server_times_s.append(server_time_s)
        chunk.gaps_s.append(gap_s)
        if len(ids) == self.interval:
            self._wake()

    def put(self, item: StreamChunk | StreamSummary) -> None:
        """A chunk joins the held one; the summary ends the stream (nothing goes in after it)."""
        if type(item) is StreamChunk:
            chunk = self._chunk
            if chunk is None:
                chunk = self._open(item.first_index)
            elif not chunk.token_ids:
                chunk.first_index = item.first_index
            chunk.token_ids += item.token_ids
            if item.text:
                self._texts.append(item.text)
            chunk.server_times_s += item.server_times_s
            chunk.gaps_s += item.gaps_s
            if len(chunk.token_ids) >= self.interval:
                self._wake()
        else:
            self._summary = item  # type: ignore[assignment]
            self._wake()

    def get_nowait(self) -> StreamChunk | StreamSummary:
        """The chunk held, else the summary; ``IndexError`` when empty."""
        chunk = self._chunk
        if chunk is not None:
            self._chunk = None
            texts, self._texts = self._texts, []
            chunk.text = texts[0] if len(texts) == 1 else "".join(texts)
            return chunk
        summary = self._summary
        if summary is None:
            raise IndexError("the stream's buffer is empty")
        self._summary = None
        return summary

    def ready(self) -> bool:
        """Whether the consumer takes something now: the summary, the first chunk, or a chunk
        of ``interval`` tokens."""
        chunk = self._chunk
        if self._summary is not None:
            return True
        return chunk is not None and (self._first or len(chunk.token_ids) >= self.interval)

    async def get(self) -> StreamChunk | StreamSummary:
        """The chunk held once it is ready (:meth:`ready`), else the summary."""
        while not self.ready():
            self._waiter = asyncio.get_running_loop().create_future()
            await self._waiter
        self._first = False
        return self.get_nowait()

    def _open(self, first_index: int) -> StreamChunk:
        chunk = self._chunk = StreamChunk([], "", first_index, [], [])
        if self._first or self.interval == 1:
            self._wake()
        return chunk

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)


@dataclass
class RequestStream:
    request_id: str
    prompt_tokens: int
    tokenizer: Tokenizer
    arrival_s: float = field(default_factory=time.monotonic)  # on ``clock``
    clock: Callable[[], float] = time.monotonic
    route: Route | None = None
    stream_interval: int = 1  # tokens a message waits for (``ChunkBuffer``)
    finished: bool = False
    _next_index: int = 0
    _pending: dict[int, tuple[int, float, float]] = field(default_factory=dict)  # index -> token, times
    _last_rank_s: float | None = None  # the decode rank's reading for the previous token
    _gaps: list[float] = field(default_factory=list)
    _ttft_s: float | None = None
    # when the request asked for them: output index -> its logprobs (as deltas bring them, read
    # as chunks go out: ``logprobs_of``), and its prompt's (with its first tokens)
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    prompt_logprobs: tuple[TokenLogprobs | None, ...] = ()
    migrations: int = 0  # decode ranks this stream moved away from (theirs failed)
    seed: int | None = None  # the request's seed, as its bill reports it
    # texts of token pairs, shared by the streams of one tokenizer (``detokenizer``)
    detokenizer_cache: PairCache | None = None
    _detokenizer: StreamDetokenizer = field(init=False)
    _tokens: list[int] = field(init=False)
    buffer: ChunkBuffer = field(init=False)

    def __post_init__(self) -> None:
        if self.detokenizer_cache is None:
            self.detokenizer_cache = PairCache(self.tokenizer)
        self._detokenizer = StreamDetokenizer(self.detokenizer_cache)
        self._tokens = self._detokenizer.ids  # the detokenizer keeps every token streamed, in order
        self.buffer = ChunkBuffer(self.stream_interval)

    def on_delta(self, delta: TokenDelta) -> int:
        """Stream the tokens ``delta`` completes; how many (0: it completes nothing)."""
        return self.on_tokens(delta.start_index, delta.token_ids, delta.times_s, delta.times_unix_s)

    def on_token(self, index: int, token: int, rank_s: float, unix_s: float) -> int:
        """:meth:`on_tokens` of one token (a decode step's: the usual case, in order and not the
        first, streamed here without a call more than it needs)."""
        if index != self._next_index or not index or self._pending or self.finished:
            return self.on_tokens(index, (token,), (rank_s,), (unix_s,))
        last_rank_s = self._last_rank_s
        if last_rank_s is not None and rank_s == rank_s:  # both readings exist (not NaN)
            gap = rank_s - last_rank_s
            self._gaps.append(gap)
            self._last_rank_s = rank_s
        else:
            gap = 0.0
            self._last_rank_s = rank_s if rank_s == rank_s else None
        self._next_index = index + 1
        self.buffer.add(index, token, self._detokenizer.add(token), unix_s, gap)
        return 1

    def on_tokens(
        self,
        start_index: int,
        token_ids: Sequence[int],
        times_s: Sequence[float],
        times_unix_s: Sequence[float],
    ) -> int:
        """Stream output tokens ``start_index`` onwards, with the decode rank's clock readings and
        wall times of each; how many it completes in order (0: none). A token past a gap waits
        for the gap; one already streamed is dropped."""
        if self.finished:
            return 0
        if start_index == self._next_index and not self._pending:  # in order: the usual case
            self._emit(token_ids, times_s, times_unix_s)
            return len(token_ids)
        for offset, token in enumerate(token_ids):
            index = start_index + offset
            if index >= self._next_index:
                self._pending.setdefault(index, (token, times_s[offset], times_unix_s[offset]))
        return self._drain()

    def add_logprobs(self, start_index: int, entries: Sequence[TokenLogprobs | None]) -> None:
        """The logprobs of output tokens ``start_index`` onwards (before the tokens themselves);
        the first to come for an index stays (a repeated delta brings the same)."""
        for offset, entry in enumerate(entries):
            if entry is not None:
                self.logprobs.setdefault(start_index + offset, entry)

    def logprobs_of(self, first_index: int, count: int) -> list[TokenLogprobs | None]:
        """The logprobs of output tokens ``first_index .. first_index + count - 1``."""
        return [self.logprobs.get(i) for i in range(first_index, first_index + count)]

    @property
    def tokens(self) -> list[int]:
        """The output tokens streamed so far, in order."""
        return list(self._tokens)

    def migrated(self) -> None:
        """Its decode rank failed and the request resumes on another from the tokens streamed
        so far: what the old rank sent past them is dropped, and the next token's gap is not
        made from two ranks' clocks (it counts as no gap, like a token no delta brought)."""
        self._pending.clear()
        self._last_rank_s = None
        self.migrations += 1

    def on_result(self, result: RequestResult) -> StreamSummary:
        """End the stream with ``result``: any tokens not streamed yet, then the summary."""
        bill = result.bill
        self.add_logprobs(0, result.logprobs)
        if result.prompt_logprobs and not self.prompt_logprobs:
            self.prompt_logprobs = result.prompt_logprobs
        if bill.prompt_tokens == 0:  # ended before its rank counted it (a failed group)
            bill = replace(bill, prompt_tokens=self.prompt_tokens)
        if self.migrations or bill.seed != self.seed:
            bill = replace(bill, migrations=self.migrations, seed=self.seed)
        for index in range(self._next_index, len(result.token_ids)):
            # tokens no delta brought have no reading of the decode rank: no gap is made up
            self._pending.setdefault(index, (result.token_ids[index], float("nan"), time.time()))
        self._drain()
        tail = self._detokenizer.finish()
        if tail:
            self.buffer.put(StreamChunk([], tail, self._next_index))
        summary = StreamSummary(
            finish_reason=result.finish_reason,
            error=result.error,
            token_ids=list(self._tokens),
            text=self.tokenizer.decode(self._tokens),
            bill=bill,
            route=self.route,
            prefill_rank=result.prefill_rank,
            decode_rank=result.decode_rank,
            ttft_s=self._ttft_s or 0.0,
            e2e_s=self.clock() - self.arrival_s,
            token_gaps_s=tuple(self._gaps),
            logprobs=tuple(self.logprobs_of(0, len(self._tokens))) if self.logprobs else (),
            prompt_logprobs=self.prompt_logprobs,
        )
        self.finished = True
        self.buffer.put(summary)
        return summary

    def fail(self, reason: str, decode_rank: RankId | None = None) -> StreamSummary:
        """End the stream with an error the ranks did not report (e.g. its rank is gone)."""
        bill = Bill(prompt_tokens=self.prompt_tokens)
        tokens = tuple(self._tokens)
        return self.on_result(
            RequestResult(self.request_id, tokens, FinishReason.ERROR, bill, decode_rank, error=reason)
        )

    def _drain(self) -> int:
        """Stream the pending tokens from the next expected index on; how many."""
        pending = self._pending
        tokens: list[int] = []
        rank_times: list[float] = []
        unix_times: list[float] = []
        while (index := self._next_index + len(tokens)) in pending:
            token, rank_s, unix_s = pending.pop(index)
            tokens.append(token)
            rank_times.append(rank_s)
            unix_times.append(unix_s)
        self._emit(tokens, rank_times, unix_times)
        return len(tokens)

    def _emit(self, tokens: Sequence[int], rank_times: Sequence[float], unix_times: Sequence[float]) -> None:
        """Stream ``tokens``, the next ones in order, with their rank's clock readings (NaN:
        none) and wall times: their text and timings."""
        index, last_rank_s, add = self._next_index, self._last_rank_s, self._detokenizer.add
        put = self.buffer.add
        for token, rank_s, unix_s in zip(tokens, rank_times, unix_times, strict=True):
            if index == 0:
                self._ttft_s = gap = self.clock() - self.arrival_s  # the first token is here now
            elif last_rank_s is not None and rank_s == rank_s:  # both readings exist (not NaN)
                gap = rank_s - last_rank_s
                self._gaps.append(gap)
            else:
                gap = 0.0
            last_rank_s = rank_s if rank_s == rank_s else None
            put(index, token, add(token), unix_s, gap)
            index += 1
        self._next_index, self._last_rank_s = index, last_rank_s
