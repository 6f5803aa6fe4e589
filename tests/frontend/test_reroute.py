"""A decode rank that is being drained refuses a request; the frontend routes it again on the
next view, and the request ends normally. A decode rank with no open channel is not routed to,
and one whose channel ended after the route was chosen is routed around. Fake channels stand in
for the ranks' channels: what is tested is the frontend's own path; the drained rank's refusal
comes as a fake channel's answer or, in the last test, as the answer on a real channel
(``cluster/channel_server.py``)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

from tandem.cluster.channel_server import ChannelServer
from tandem.engine.rank_loop import RankDraining
from tandem.frontend.core import FrontendConfig, FrontendCore
from tandem.frontend.rank_channel import RankChannel, SubmitRefused
from tandem.frontend.running import GenerateSpec
from tandem.wire.messages import Bill, RankId, RankRequest, RequestResult, Role, StreamBatch
from tandem.wire.request_params import FinishReason, SamplingParams
from tandem.wire.routing_view import GroupState, GroupView, RoutingView
from tandem.wire.stream_summary import StreamSummary

PREFILL, DRAINED, OPEN = RankId("prefill0", 0), RankId("decode0", 0), RankId("decode1", 0)


class _Decode:
    """A decode rank's channel: takes a submit (or refuses it while draining), decodes two
    tokens and reports the result."""

    def __init__(self, rank: RankId, core: FrontendCore, draining: bool, hold: bool = False) -> None:
        self.rank, self.core, self.draining, self.hold = rank, core, draining, hold
        self.received: list[str] = []
        self.is_open = True

    def submit(self, requests: list[RankRequest]) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.received += [r.request_id for r in requests]
        if self.draining:
            future.set_exception(SubmitRefused(str(RankDraining(self.rank.name)), draining=True))
        else:
            future.set_result(None)
            for r in [] if self.hold else requests:  # held: taken, and no token comes
                result = RequestResult(
                    r.request_id, (5, 6), FinishReason.LENGTH, Bill(prompt_tokens=3), self.rank
                )
                batch = StreamBatch.of(self.rank, (), (result,))
                asyncio.get_running_loop().call_later(0.01, self.core.on_stream, batch)
        return future

    def abort(self, request_ids: list[str]) -> None:
        return None


def _view(decode: dict[RankId, Any], draining: tuple[RankId, ...] = ()) -> RoutingView:
    """Prefill0 and the ``decode`` ranks taking work; the ``draining`` ones' groups shown as the
    controller shows a group being drained (in the view, taking no work)."""
    groups = tuple(GroupView(r.group_id, Role.DECODE, GroupState.READY, 1, (r,)) for r in decode)
    groups += tuple(GroupView(r.group_id, Role.DECODE, GroupState.DRAINING, 1, (r,)) for r in draining)
    return RoutingView(
        prefill={PREFILL: object()},
        decode=decode,
        groups=(GroupView("prefill0", Role.PREFILL, "ready", 1, (PREFILL,)), *groups),
        page_size=16,
        prefill_capacity_tokens=1024,
        decode_capacity_tokens=1024,
    )


def _show(core: FrontendCore, view: RoutingView) -> None:
    """What ``refresh`` does with a controller's view, without the controller."""
    core.membership.view = view
    core.membership.incarnations = {r: 1 for g in view.groups for r in g.ranks}
    for rank, channel in view.decode.items():
        core.membership.channels.setdefault((rank, 1), channel)
    core.router.set_ranks(list(view.prefill), list(view.decode))
    for rank in view.decode:  # the drained rank looks emptiest: the router picks it first
        core.router.update_decode_stats(rank, 64 if rank == DRAINED else 32, 0, 64)
    core.ready = True


def test_a_draining_rank_refuses_and_the_request_goes_to_the_next_view(tiny_dir: Path) -> None:
    async def run() -> tuple[StreamSummary, _Decode, _Decode]:
        core = FrontendCore(FrontendConfig(str(tiny_dir), "tiny", refresh_s=0.05, metrics=False))
        drained, open_ = _Decode(DRAINED, core, draining=True), _Decode(OPEN, core, draining=False)
        _show(core, _view({DRAINED: drained, OPEN: open_}))  # a view from before the drain

        async def next_view() -> None:
            await asyncio.sleep(0.02)  # the controller's next view leaves the drained rank out
            _show(core, _view({OPEN: open_}))

        refresh = asyncio.create_task(next_view())
        spec = GenerateSpec("r1", [1, 2, 3], SamplingParams(max_tokens=2))
        items = [item async for item in core.generate(spec)]
        await refresh
        summary = items[-1]
        assert isinstance(summary, StreamSummary)
        return summary, drained, open_

    summary, drained, open_ = asyncio.run(run())
    assert summary.error is None and summary.token_ids == [5, 6] and summary.decode_rank == OPEN
    assert len(drained.received) == 1 and len(open_.received) == 1
    assert drained.received[0] != open_.received[0]  # a fresh rank request id each time


def test_a_rank_that_keeps_refusing_fails_the_request_with_its_reason(tiny_dir: Path) -> None:
    async def run() -> StreamSummary:
        core = FrontendCore(FrontendConfig(str(tiny_dir), "tiny", refresh_s=0.01, metrics=False))
        _show(core, _view({DRAINED: _Decode(DRAINED, core, draining=True)}))  # no other rank, ever
        items = [
            item async for item in core.generate(GenerateSpec("r2", [1, 2, 3], SamplingParams(max_tokens=2)))
        ]
        summary = items[-1]
        assert isinstance(summary, StreamSummary)
        return summary

    summary = asyncio.run(run())
    assert summary.finish_reason == "error" and "is draining" in (summary.error or "")


def test_a_draining_ranks_channel_stays_open_until_its_refusal_has_come(tiny_dir: Path) -> None:
    """The view that shows the drained rank's group draining comes while its submit waits on the
    channel: the channel is kept (a group being drained still streams its requests' tokens), the
    refusal comes on it and the request goes to the open rank; the channel is dropped at the
    first view after the group has left."""
    entered, release = threading.Event(), threading.Event()
    taken: list[str] = []

    def drained_rank(items: list[Any]) -> None:
        taken.extend(r.request_id for r in items)
        entered.set()
        release.wait(10)
        raise RankDraining(DRAINED.name)

    server = ChannelServer("127.0.0.1", drained_rank, lambda ids: None)

    async def run() -> tuple[StreamSummary, _Decode, RankChannel]:
        core = FrontendCore(FrontendConfig(str(tiny_dir), "tiny", refresh_s=0.05, metrics=False))
        open_ = _Decode(OPEN, core, draining=False)
        channel = await RankChannel.open(server.endpoint(), "tiny", core.on_stream)
        core.membership.channels[(DRAINED, 1)] = channel
        _show(core, _view({DRAINED: object(), OPEN: open_}))
        generate = asyncio.create_task(
            _collect(core, GenerateSpec("r3", [1, 2, 3], SamplingParams(max_tokens=2)))
        )
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        draining = _view({OPEN: open_}, draining=(DRAINED,))
        _show(core, draining)
        core.membership.keep_channels(draining)
        assert channel.is_open and channel.waiting == 1 and (DRAINED, 1) in core.membership.channels
        release.set()
        summary = await generate
        core.membership.keep_channels(draining)
        assert channel.is_open  # still in the view: kept
        core.membership.keep_channels(_view({OPEN: open_}))  # stopped and gone
        assert (DRAINED, 1) not in core.membership.channels
        return summary, open_, channel

    try:
        summary, open_, channel = asyncio.run(run())
    finally:
        release.set()
        server.close()
    assert summary.error is None and summary.decode_rank == OPEN and summary.token_ids == [5, 6]
    # the drained rank was reached over its channel, and the request went on to the open one
    assert len(taken) == 1 and len(open_.received) == 1
    assert taken[0] != open_.received[0]
    assert not channel.is_open


def test_a_rank_with_no_open_channel_is_not_routed_to(tiny_dir: Path) -> None:
    """The router is offered only the decode ranks whose channel is open; a rank whose channel
    ended after the route was chosen (``RankNotReachable``) is routed around, not waited on."""

    async def run() -> None:
        core = FrontendCore(FrontendConfig(str(tiny_dir), "tiny", refresh_s=0.05, metrics=False))
        closed, open_ = _Decode(DRAINED, core, draining=False), _Decode(OPEN, core, draining=False)
        view = _view({DRAINED: closed, OPEN: open_})
        _show(core, view)
        core.membership.view = view
        closed.is_open = False  # its channel ended; the router still has it, and prefers it
        summary = await _collect(core, GenerateSpec("r4", [1, 2, 3], SamplingParams(max_tokens=2)))
        assert summary.error is None and summary.decode_rank == OPEN and closed.received == []
        assert core.membership.submits == {"channel": 1, "unreachable": 1}
        assert core.router.decode_ranks == [OPEN]  # offered no more
        del core.membership.channels[(DRAINED, 1)]  # not opened yet, as for a rank just seen
        core.membership.route_over(view)
        assert core.router.decode_ranks == [OPEN]
        for i in range(3):
            summary = await _collect(core, GenerateSpec(f"r5-{i}", [1, 2, 3], SamplingParams(max_tokens=2)))
            assert summary.decode_rank == OPEN
        core.membership.channels[(DRAINED, 1)] = closed
        closed.is_open = True  # opened: offered again
        core.membership.route_over(view)
        assert core.router.decode_ranks == sorted([DRAINED, OPEN])
        assert closed.received == []

    asyncio.run(run())


def test_the_requests_of_a_channel_that_ends_move_to_another_rank(tiny_dir: Path) -> None:
    """A decode rank's channel ends while it holds a request (its tokens would come on it): the
    request resumes on another rank, and the rank is offered to the router no more."""

    async def run() -> None:
        core = FrontendCore(FrontendConfig(str(tiny_dir), "tiny", refresh_s=0.05, metrics=False))
        held, open_ = _Decode(DRAINED, core, draining=False, hold=True), _Decode(OPEN, core, draining=False)
        view = _view({DRAINED: held, OPEN: open_})
        _show(core, view)
        generate = asyncio.create_task(
            _collect(core, GenerateSpec("r6", [1, 2, 3], SamplingParams(max_tokens=2)))
        )
        while not held.received:
            await asyncio.sleep(0.001)
        await asyncio.sleep(0.05)
        assert not generate.done() and open_.received == []  # held there: nothing moves yet
        held.is_open = False
        core.membership._ended((DRAINED, 1), held, "the rank closed the channel")  # type: ignore[arg-type]
        summary = await asyncio.wait_for(generate, 10)
        assert summary.error is None and summary.decode_rank == OPEN and summary.token_ids == [5, 6]
        assert summary.bill.migrations == 1 and len(open_.received) == 1
        assert core.router.decode_ranks == [OPEN]

    asyncio.run(run())


async def _collect(core: FrontendCore, spec: GenerateSpec) -> StreamSummary:
    items = [item async for item in core.generate(spec)]
    assert isinstance(items[-1], StreamSummary)
    return items[-1]
