"""A request's stream at the frontend: deltas put in order, chunks with timings, the result's
tokens authoritative; time to first token on the frontend's clock, gaps on the decode rank's."""

from __future__ import annotations

import asyncio

import pytest

from tandem.frontend.request_stream import RequestStream, StreamChunk
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.model.tokenizer import Tokenizer
from tandem.wire.messages import Bill, RankId, RequestResult, TokenDelta
from tandem.wire.request_params import FinishReason
from tandem.wire.stream_summary import StreamSummary


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    return Tokenizer.from_dir(make_tiny_checkpoint(tmp_path_factory.mktemp("stream") / "tiny"))


def _drain(stream: RequestStream) -> list[StreamChunk | StreamSummary]:
    items = []
    while not stream.buffer.empty():
        items.append(stream.buffer.get_nowait())
    return items


class Clock:
    """The frontend's clock, moved by hand."""

    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def _stream(tokenizer: Tokenizer, clock: Clock | None = None) -> RequestStream:
    async def make() -> RequestStream:  # the queue belongs to a running loop
        return RequestStream("r", 3, tokenizer, arrival_s=100.0, clock=clock or Clock(100.0))

    return asyncio.run(make())


def _delta(start: int, ids: list[int], rank_times: list[float]) -> TokenDelta:
    """A decode rank's delta: its own clock is unrelated to the frontend's (here, near 5000)."""
    return TokenDelta("r", start, tuple(ids), tuple(rank_times), tuple(1e9 + t for t in rank_times))


def test_deltas_out_of_order_and_repeated_come_out_once_in_order(tokenizer: Tokenizer) -> None:
    clock = Clock(100.0)
    stream = _stream(tokenizer, clock)
    ids = tokenizer.encode("hello")
    clock.now = 100.05
    assert stream.on_delta(_delta(2, ids[2:4], [5000.3, 5000.3])) == 0  # a gap: held
    assert stream.buffer.empty()
    clock.now = 100.25  # token 0 reaches the frontend 0.25 s after the request did
    assert stream.on_delta(_delta(0, ids[:2], [5000.1, 5000.2])) == 4  # the held tokens follow at once
    (first,) = _drain(stream)
    assert isinstance(first, StreamChunk) and first.token_ids == ids[:4]
    assert [t.index for t in first.timings] == [0, 1, 2, 3]
    # token 0: the frontend's time to first token; the rest: the decode rank's own gaps
    assert [round(t.gap_s, 6) for t in first.timings] == [0.25, 0.1, 0.1, 0.0]
    assert stream.on_delta(_delta(1, ids[1:3], [5000.2, 5000.3])) == 0  # a repeat
    ranks = RankId("decode0", 1), RankId("prefill0", 0)
    result = RequestResult("r", tuple(ids), FinishReason.LENGTH, Bill(prompt_tokens=3), *ranks)
    clock.now = 101.5
    summary = stream.on_result(result)
    items = [first, *_drain(stream)]
    assert items[-1] is summary and summary.token_ids == ids and summary.text == "hello"
    chunks = [i for i in items if isinstance(i, StreamChunk)]
    assert [t for c in chunks for t in c.token_ids] == ids  # the last token came only with the result
    assert "".join(c.text for c in chunks) == "hello"
    assert summary.ttft_s == pytest.approx(0.25) and summary.e2e_s == pytest.approx(1.5)
    # the last token had no reading of the decode rank's clock: no gap is made up for it
    assert summary.token_gaps_s == pytest.approx((0.1, 0.1, 0.0))
    assert stream.on_delta(_delta(5, [1], [5001.0])) == 0  # after the end: ignored


def test_a_character_split_across_tokens_is_held_until_complete(tokenizer: Tokenizer) -> None:
    stream = _stream(tokenizer)
    ids = tokenizer.encode("é")[-2:]  # two byte-level tokens (after the BOS)
    assert len(ids) == 2
    assert stream.on_delta(_delta(0, [ids[0]], [100.1])) == 1
    (chunk,) = _drain(stream)  # the token goes out; its half character does not
    assert isinstance(chunk, StreamChunk) and chunk.text == "" and chunk.token_ids == [ids[0]]
    assert stream.on_delta(_delta(1, [ids[1]], [100.2])) == 1
    (chunk,) = _drain(stream)
    assert isinstance(chunk, StreamChunk) and chunk.text == "é" and chunk.token_ids == [ids[1]]


def test_tokens_the_client_has_not_taken_join_one_chunk(tokenizer: Tokenizer) -> None:
    """A reader slower than its tokens gets every token since its last read in one message,
    and the buffer holds one chunk however many deltas came."""
    stream = _stream(tokenizer)
    ids = tokenizer.encode("slow reader")[1:]
    for i, token in enumerate(ids):
        assert stream.on_delta(_delta(i, [token], [100.0 + i])) == 1
        assert len(stream.buffer) == 1 and stream.buffer.tokens == i + 1
    (chunk,) = _drain(stream)
    assert isinstance(chunk, StreamChunk) and chunk.token_ids == ids and chunk.text == "slow reader"
    assert [t.index for t in chunk.timings] == list(range(len(ids)))
    assert [t.gap_s for t in chunk.timings[1:]] == [1.0] * (len(ids) - 1)
    assert stream.buffer.tokens == 0 and stream.buffer.empty()


def test_a_failure_ends_the_stream_with_the_tokens_so_far(tokenizer: Tokenizer) -> None:
    stream = _stream(tokenizer)
    stream.on_delta(_delta(0, [65, 66], [100.1, 100.2]))
    summary = stream.fail("decode rank decode0-r0 failed", RankId("decode0", 0))
    assert summary.finish_reason == "error" and summary.error == "decode rank decode0-r0 failed"
    assert summary.token_ids == [65, 66] and stream.finished


def test_with_a_stream_interval_a_message_waits_for_that_many_tokens(tokenizer: Tokenizer) -> None:
    """Interval 3: the first token goes at once, then a chunk once it holds 3 tokens; the end
    takes what is held, then the summary."""
    ids = tokenizer.encode("abcdefgh")[1:]

    async def run() -> list[list[int]]:
        stream = RequestStream("r", 3, tokenizer, stream_interval=3)
        taken: list[list[int]] = []
        for i, token in enumerate(ids[:7]):
            stream.on_delta(_delta(i, [token], [100.0 + i]))
            while stream.buffer.ready():
                item = await stream.buffer.get()
                assert isinstance(item, StreamChunk)
                taken.append(item.token_ids)
        assert stream.buffer.tokens == 0  # 1 + 3 + 3 tokens: nothing waits
        stream.on_delta(_delta(7, [ids[7]], [107.0]))
        assert not stream.buffer.ready() and stream.buffer.tokens == 1  # held: fewer than 3
        result = RequestResult("r", tuple(ids), FinishReason.LENGTH, Bill(prompt_tokens=3), RankId("d", 0))
        stream.on_result(result)
        rest = [await stream.buffer.get(), await stream.buffer.get()]
        assert isinstance(rest[0], StreamChunk) and isinstance(rest[1], StreamSummary)
        assert stream.buffer.empty()
        return [*taken, rest[0].token_ids]

    assert asyncio.run(run()) == [ids[:1], ids[1:4], ids[4:7], ids[7:]]
