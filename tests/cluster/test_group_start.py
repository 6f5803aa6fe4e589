"""Groups start side by side: every start is under way before any ends (with one after another,
the barrier below would never fill), ``start_concurrency`` caps how many at once, and a failed
start does not stop the others, its error raised once all have ended."""

from __future__ import annotations

import itertools
import threading
import time
from typing import cast

import pytest

from tandem.cluster.group import GroupFailed, RankGroup, start_groups
from tandem.cluster.topology import Topology


class _Group:
    def __init__(self, name: str, barrier: threading.Barrier | None = None, fail: bool = False) -> None:
        self.name, self.barrier, self.fail = name, barrier, fail
        self.started = self.ended = 0.0

    def start(self) -> None:
        self.started = time.monotonic()
        if self.barrier is not None:
            self.barrier.wait(timeout=5)  # BrokenBarrierError unless every group is starting
        time.sleep(0.05)
        self.ended = time.monotonic()
        if self.fail:
            raise GroupFailed(self.name, 1, "start failed: no room")


def _start(groups: list[_Group], concurrency: int | None = None) -> None:
    start_groups(cast(list[RankGroup], groups), concurrency)


def test_every_group_is_starting_before_any_has_started() -> None:
    barrier = threading.Barrier(4)
    groups = [_Group(f"g{i}", barrier) for i in range(4)]
    _start(groups)
    assert all(g.ended for g in groups)


def test_a_concurrency_of_one_starts_them_one_after_another_in_order() -> None:
    groups = [_Group(f"g{i}") for i in range(3)]
    _start(groups, 1)
    for before, after in itertools.pairwise(groups):
        assert after.started >= before.ended


def test_a_failed_start_is_raised_after_the_others_have_started() -> None:
    barrier = threading.Barrier(3)
    groups = [_Group("g0", barrier), _Group("g1", barrier, fail=True), _Group("g2", barrier)]
    with pytest.raises(GroupFailed, match="g1 incarnation 1 failed: start failed: no room"):
        _start(groups)
    assert groups[0].ended and groups[2].ended


def test_a_start_concurrency_below_one_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="start concurrency"):
        _start([_Group("g0")], 0)
    with pytest.raises(ValueError, match="start_concurrency"):
        Topology.model_validate({"start_concurrency": 0})
    assert Topology.preset("local").start_concurrency is None  # by default every group at once
