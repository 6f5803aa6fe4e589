"""Request ids and limits per client, on the frontend's own path: a fake decode rank's channel
stands in for the rank's. It holds every request until told to abort it, then reports the abort."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tandem.frontend.core import DuplicateRequest, FrontendConfig, FrontendCore, FrontendOverloaded
from tandem.frontend.limits import EdgeLimits
from tandem.frontend.request_stream import StreamChunk
from tandem.frontend.running import GenerateSpec, RequestKey
from tandem.wire.messages import Bill, RankId, RankRequest, RequestResult, Role, StreamBatch
from tandem.wire.request_params import FinishReason, SamplingParams
from tandem.wire.routing_view import GroupView, RoutingView
from tandem.wire.stream_summary import StreamSummary

PREFILL, DECODE = RankId("prefill0", 0), RankId("decode0", 0)


class _HoldingRank:
    """A channel to a rank: ``submit`` keeps the requests; ``abort`` reports each one aborted,
    as a rank does."""

    def __init__(self, core: FrontendCore) -> None:
        self.core = core
        self.held: list[str] = []
        self.aborted: list[str] = []
        self.is_open = True

    def submit(self, requests: list[RankRequest]) -> asyncio.Future[None]:
        self.held += [r.request_id for r in requests]
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    def abort(self, request_ids: list[str]) -> None:
        self.aborted += request_ids
        results = tuple(
            RequestResult(i, (), FinishReason.ABORT, Bill(prompt_tokens=3), DECODE) for i in request_ids
        )
        asyncio.get_running_loop().call_soon(self.core.on_stream, StreamBatch.of(DECODE, (), results))


def _ready_core(tiny_dir: Path, limits: EdgeLimits | None = None) -> tuple[FrontendCore, _HoldingRank]:
    core = FrontendCore(FrontendConfig(str(tiny_dir), "tiny", metrics=False, limits=limits or EdgeLimits()))
    rank = _HoldingRank(core)
    view = RoutingView(
        prefill={PREFILL: object()},
        decode={DECODE: object()},
        groups=(
            GroupView("prefill0", Role.PREFILL, "ready", 1, (PREFILL,)),
            GroupView("decode0", Role.DECODE, "ready", 1, (DECODE,)),
        ),
        page_size=16,
        prefill_capacity_tokens=1024,
        decode_capacity_tokens=1024,
    )
    core.membership.view, core.ready = view, True
    core.membership.incarnations = {PREFILL: 1, DECODE: 1}
    core.membership.channels[(DECODE, 1)] = rank  # type: ignore[assignment]
    core.router.set_ranks([PREFILL], [DECODE])
    core.router.update_decode_stats(DECODE, 64, 0, 64)
    return core, rank


def _spec(request_id: str, client: str) -> GenerateSpec:
    return GenerateSpec(request_id, [1, 2, 3], SamplingParams(max_tokens=4), client=client)


def test_two_clients_may_run_one_id_and_abort_reaches_only_the_callers(tiny_dir: Path) -> None:
    async def run() -> None:
        core, rank = _ready_core(tiny_dir)
        alice = core.generate(_spec("same", "alice"))
        bob = core.generate(_spec("same", "bob"))
        alice_first, bob_first = asyncio.ensure_future(anext(alice)), asyncio.ensure_future(anext(bob))
        while len(rank.held) < 2:
            await asyncio.sleep(0)
        assert set(core.running) == {RequestKey("alice", "same"), RequestKey("bob", "same")}
        assert len(set(rank.held)) == 2  # the ranks know them apart
        with pytest.raises(DuplicateRequest):  # one id twice within one client is still refused
            await anext(core.generate(_spec("same", "alice")))
        assert not core.abort("same", "carol")  # nobody else reaches either
        assert not core.abort("same")  # nor the anonymous client
        assert core.abort("same", "bob")
        summary = await bob_first
        assert isinstance(summary, StreamSummary) and summary.finish_reason == FinishReason.ABORT
        await asyncio.sleep(0.01)
        assert not alice_first.done() and RequestKey("alice", "same") in core.running
        assert core.abort("same", "alice")
        assert isinstance(await alice_first, StreamSummary)
        for stream in (alice, bob):
            await stream.aclose()
        assert core.running == {} and core._per_client == {}

    asyncio.run(run())


def test_a_client_at_its_limit_is_refused_and_others_are_not(tiny_dir: Path) -> None:
    async def run() -> None:
        core, rank = _ready_core(tiny_dir, EdgeLimits(max_requests_per_client=2))
        streams = [core.generate(_spec(f"a{i}", "alice")) for i in range(2)]
        firsts = [asyncio.ensure_future(anext(s)) for s in streams]
        while len(rank.held) < 2:
            await asyncio.sleep(0)
        with pytest.raises(FrontendOverloaded, match=r"max_requests_per_client=2"):
            await anext(core.generate(_spec("a2", "alice")))
        bob = core.generate(_spec("b0", "bob"))  # another client still runs
        bob_first = asyncio.ensure_future(anext(bob))
        while len(rank.held) < 3:
            await asyncio.sleep(0)
        assert core.abort("a0", "alice")
        await firsts[0]
        await streams[0].aclose()  # alice's stream ended: she has room for one more
        again = core.generate(_spec("a2", "alice"))
        again_first = asyncio.ensure_future(anext(again))
        while len(rank.held) < 4:
            await asyncio.sleep(0)
        for client, request_id, first in [("alice", "a1", firsts[1]), ("bob", "b0", bob_first)]:
            assert core.abort(request_id, client)
            await first
        assert core.abort("a2", "alice")
        await again_first
        for stream in (streams[1], bob, again):
            await stream.aclose()
        assert core._per_client == {}

    asyncio.run(run())


def test_a_stream_that_is_not_read_holds_a_bounded_buffer(tiny_dir: Path) -> None:
    """Deltas keep coming while the client reads nothing: the stream holds one chunk that the
    tokens join instead of queueing one per step; what the client finally reads is every token,
    in order."""
    from tandem.wire.messages import TokenDelta

    async def run() -> None:
        core, rank = _ready_core(tiny_dir, EdgeLimits())
        spec = GenerateSpec("slow", [1, 2, 3], SamplingParams(max_tokens=200), client="alice")
        stream = core.generate(spec)
        first = asyncio.ensure_future(anext(stream))
        while not rank.held:
            await asyncio.sleep(0)
        (rank_id,) = rank.held
        tokens = [(7 * i) % 250 for i in range(200)]
        core.on_stream(StreamBatch.of(DECODE, (TokenDelta(rank_id, 0, (tokens[0],), (0.0,), (0.0,)),), ()))
        await first  # the reader takes the first chunk, then stops reading
        for i in range(1, 200):
            delta = TokenDelta(rank_id, i, (tokens[i],), (float(i),), (float(i),))
            core.on_stream(StreamBatch.of(DECODE, (delta,), ()))
            (buffer,) = core.stream_buffers()
            assert buffer.items == 1 and buffer.key == RequestKey("alice", "slow")
        (buffer,) = core.stream_buffers()
        assert buffer.items == 1 and buffer.tokens == 199
        result = RequestResult(rank_id, tuple(tokens), FinishReason.LENGTH, Bill(prompt_tokens=3), DECODE)
        core.on_stream(StreamBatch.of(DECODE, (), (result,)))
        assert core.stream_buffers()[0].items == 2  # the summary always goes in
        rest = [item async for item in stream]
        chunks = [i for i in rest if isinstance(i, StreamChunk)]
        assert len(chunks) == 1  # every token since the last read: one message
        assert [t for c in chunks for t in c.token_ids] == tokens[1:]
        assert [t.index for c in chunks for t in c.timings] == list(range(1, 200))
        assert isinstance(rest[-1], StreamSummary) and rest[-1].token_ids == tokens

    asyncio.run(run())


def test_tokens_for_a_request_no_stream_waits_for_get_it_aborted(tiny_dir: Path) -> None:
    """A restarted frontend has lost its streams, but the decode rank still pushes their tokens:
    each such request is aborted on the rank (which frees its pages), and a live request's
    tokens are never taken for an orphan's."""
    from tandem.wire.messages import TokenDelta

    async def scenario() -> None:
        core, rank = _ready_core(tiny_dir)
        stream = core.generate(GenerateSpec("live", [1, 2, 3], SamplingParams(max_tokens=4)))
        first = asyncio.ensure_future(stream.__anext__())
        await asyncio.sleep(0)
        (live,) = rank.held
        orphan = TokenDelta("lost-before-restart", 0, (5,), (1.0,), (1.0,))
        core.on_stream(StreamBatch.of(DECODE, (orphan, TokenDelta(live, 0, (7,), (1.0,), (1.0,))), ()))
        chunk = await first
        assert isinstance(chunk, StreamChunk) and chunk.token_ids == [7]
        assert rank.aborted == ["lost-before-restart"] and core.orphans_aborted == 1
        await stream.aclose()

    asyncio.run(scenario())
