"""The frontend applies each prefill rank's KV events in order, from the incarnation it follows."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.frontend.core import FrontendConfig, FrontendCore
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from tandem.wire.messages import RankId

PREFILL = RankId("prefill0", 0)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("events") / "tiny")


def _core(tiny: Path) -> FrontendCore:
    core = FrontendCore(FrontendConfig(str(tiny), "tiny"))
    core.router.set_ranks([PREFILL], [RankId("decode0", 0)])
    core.kv_events.following[PREFILL] = 1  # following incarnation 1
    return core


def _stored(*hashes: int) -> list[BlockStored]:
    return [BlockStored(tuple(hashes), None, 8)]


def test_batches_apply_in_sequence_order(tiny: Path) -> None:
    core = _core(tiny)
    rank = PREFILL
    core.on_kv_events(KVEventBatch(rank, 1, 2, False, [BlockRemoved((1,))]))  # early: held
    core.on_kv_events(KVEventBatch(rank, 1, 1, False, _stored(2)))  # early: held
    assert core.router.cached_blocks()[rank] == 0
    core.on_kv_events(KVEventBatch(rank, 1, 0, True, [AllBlocksCleared(), *_stored(1)]))
    assert core.router.match([1]) == {}  # snapshot, then 1 stored 2, then 2 removed 1
    assert core.router.cached_blocks()[rank] == 1
    core.on_kv_events(KVEventBatch(rank, 1, 1, False, _stored(9)))  # a repeat: dropped
    assert core.router.cached_blocks()[rank] == 1
    core.router.check_integrity()


def test_batches_of_another_incarnation_are_dropped(tiny: Path) -> None:
    core = _core(tiny)
    rank = PREFILL
    core.on_kv_events(KVEventBatch(rank, 0, 0, True, [AllBlocksCleared(), *_stored(1, 2)]))
    core.on_kv_events(KVEventBatch(RankId("prefill9", 0), 1, 0, True, _stored(3)))  # not followed
    assert core.router.cached_blocks() == {rank: 0}
    core.on_kv_events(KVEventBatch(rank, 1, 0, True, [AllBlocksCleared(), *_stored(5)]))
    assert core.router.cached_blocks() == {rank: 1}
