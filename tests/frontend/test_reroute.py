"""A decode rank that is being drained refuses a request; the frontend routes it again on the
next view, and the request ends normally. Fake rank handles stand in for the Ray actors: what
is tested is the frontend's own path; the drained rank's refusal comes as an actor call's error
or, in the last test, as the answer on a real submit socket (``cluster/submit_listener.py``)."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import ray

from tandem.cluster.submit_listener import SubmitListener
from tandem.engine.rank_loop import RankDraining
from tandem.frontend.core import FrontendConfig, FrontendCore
from tandem.frontend.rank_channel import RankChannel
from tandem.frontend.running import GenerateSpec
from tandem.wire.messages import Bill, RankId, RankRequest, RequestResult, Role, StreamBatch
from tandem.wire.request_params import FinishReason, SamplingParams
from tandem.wire.routing_view import GroupView, RoutingView
from tandem.wire.stream_summary import StreamSummary

PREFILL, DRAINED, OPEN = RankId("prefill0", 0), RankId("decode0", 0), RankId("decode1", 0)


class _Submit:
    def __init__(self, handle: _Decode) -> None:
        self.handle = handle

    def remote(self, requests: list[RankRequest]) -> asyncio.Future[None]:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.handle.received += [r.request_id for r in requests]
        if self.handle.draining:
            future.set_exception(
                ray.exceptions.RayTaskError("submit", "", RankDraining(self.handle.rank.name))
            )
        else:
            future.set_result(None)
            for r in requests:  # the rank decodes two tokens and reports the result
                result = RequestResult(
                    r.request_id, (5, 6), FinishReason.LENGTH, Bill(prompt_tokens=3), self.handle.rank
                )
                batch = StreamBatch.of(self.handle.rank, (), (result,))
                asyncio.get_running_loop().call_later(0.01, self.handle.core.on_stream, batch)
        return future


class _Decode:
    def __init__(self, rank: RankId, core: FrontendCore, draining: bool) -> None:
        self.rank, self.core, self.draining = rank, core, draining
        self.received: list[str] = []
        self.submit = _Submit(self)
        self.abort = self  # abort.remote(...) is a no-op here

    def remote(self, *args: Any) -> None:
        return None


def _view(decode: dict[RankId, Any]) -> RoutingView:
    groups = tuple(GroupView(r.group_id, Role.DECODE, "ready", 1, (r,)) for r in decode)
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
    core.membership.rank_ids = {r.name: r for g in view.groups for r in g.ranks}
    core.membership.incarnations = {r: 1 for g in view.groups for r in g.ranks}
    core.router.set_ranks([r.name for r in view.prefill], [r.name for r in view.decode])
    for rank in view.decode:  # the drained rank looks emptiest: the router picks it first
        core.router.update_decode_stats(rank.name, 64 if rank == DRAINED else 32, 0, 64)
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


def test_a_draining_ranks_socket_stays_open_until_its_refusal_has_come(tiny_dir: Path) -> None:
    """The view that leaves the drained rank out comes while its submit waits on the socket: the
    channel is kept for the answer (closing it would fail the request instead of routing it
    again), and dropped at the first refresh after it."""
    entered, release = threading.Event(), threading.Event()
    taken: list[str] = []

    def drained_rank(items: list[Any]) -> None:
        taken.extend(r.request_id for r in items)
        entered.set()
        release.wait(10)
        raise RankDraining(DRAINED.name)

    listener = SubmitListener(drained_rank, "127.0.0.1")

    async def run() -> tuple[StreamSummary, _Decode, _Decode, RankChannel]:
        core = FrontendCore(FrontendConfig(str(tiny_dir), "tiny", refresh_s=0.05, metrics=False))
        drained, open_ = _Decode(DRAINED, core, draining=True), _Decode(OPEN, core, draining=False)
        _show(core, _view({DRAINED: drained, OPEN: open_}))
        channel = core.membership._channels[(DRAINED, 1)] = await RankChannel.open(listener.endpoint())
        generate = asyncio.create_task(
            _collect(core, GenerateSpec("r3", [1, 2, 3], SamplingParams(max_tokens=2)))
        )
        await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
        after = _view({OPEN: open_})
        _show(core, after)
        core.membership.keep_channels(after, core.membership.incarnations)
        assert channel.is_open and channel.waiting == 1 and (DRAINED, 1) in core.membership._channels
        release.set()
        summary = await generate
        core.membership.keep_channels(after, core.membership.incarnations)
        assert (DRAINED, 1) not in core.membership._channels
        return summary, drained, open_, channel

    try:
        summary, drained, open_, channel = asyncio.run(run())
    finally:
        release.set()
        listener.close()
    assert summary.error is None and summary.decode_rank == OPEN and summary.token_ids == [5, 6]
    # the drained rank was reached over its socket only, and the request went on to the open one
    assert len(taken) == 1 and drained.received == [] and len(open_.received) == 1
    assert taken[0] != open_.received[0]
    assert not channel.is_open


async def _collect(core: FrontendCore, spec: GenerateSpec) -> StreamSummary:
    items = [item async for item in core.generate(spec)]
    assert isinstance(items[-1], StreamSummary)
    return items[-1]
