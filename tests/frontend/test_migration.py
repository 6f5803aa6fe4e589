"""A request whose decode rank failed moves to a decode rank of another group: the resend's
submit is awaited, and a refusal from the new rank ends the stream with its error (rather than
leaving it waiting for tokens that never come)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from tandem.frontend.migration import Migration
from tandem.frontend.rank_channel import SubmitRefused
from tandem.frontend.running import GenerateSpec, Running
from tandem.wire.messages import RankId
from tandem.wire.request_params import SamplingParams


class _Stream:
    def __init__(self) -> None:
        self.tokens = [5, 6]
        self.migrations = 0
        self.finished = False
        self.failed: list[str] = []

    def migrated(self) -> None:
        self.migrations += 1

    def fail(self, reason: str, decode_rank: RankId | None = None) -> None:
        self.failed.append(reason)
        self.finished = True


def test_a_resumed_request_the_new_rank_refuses_ends_with_its_error() -> None:
    lost, other = RankId("decode0", 0), RankId("decode1", 0)
    stream = _Stream()
    spec = GenerateSpec("r", [1, 2, 3], SamplingParams(max_tokens=8))
    running = Running(stream, "r@1", lost, 1, None, spec, submitting=False)  # type: ignore[arg-type]
    routed: list[str] = []
    router = SimpleNamespace(
        decode_ranks=[lost, other],
        prefill_ranks=[],
        set_ranks=lambda prefill, decode: None,
        finished=routed.append,
    )
    membership = SimpleNamespace(view=SimpleNamespace(colocated=False), incarnations={lost: 1, other: 1})

    async def scenario() -> None:
        refused: asyncio.Future[None] = asyncio.get_running_loop().create_future()

        def resend(moved: Running, tokens: tuple[int, ...]) -> tuple[Running, Any]:
            assert tokens == (5, 6)
            moved.decode_rank = other
            return moved, refused

        tasks: set[asyncio.Future[None]] = set()
        migration = Migration(router, membership, resend, 3, 0.0, None, tasks)  # type: ignore[arg-type]
        assert migration._resume_elsewhere(running, "decode0")
        refused.set_exception(SubmitRefused("no room for it", draining=False))
        await asyncio.gather(*tasks)

    asyncio.run(scenario())
    assert routed == ["r@1"] and stream.migrations == 1
    assert (
        stream.failed and "decode rank decode1" in stream.failed[0] and "no room for it" in stream.failed[0]
    )
