"""The colocated engine with KV tiers below its pages: a prefix evicted from the device comes
back from the host tier, and another engine (another rank) reads it from the store; the tokens
are those of an engine without tiers, and each load is counted where it happened."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.kv_tiers import TierConfig, TierPrices
from tandem.engine.tier_copier import build_tiers, page_bytes, pool_block_layout
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.wire.request_params import SamplingParams
from tests.kv_store_double import DictStore

PAGE = 8


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("colocated-tiers") / "tiny", seed=3)


def _engine(
    tiny: Path, num_pages: int, host_pages: int = 0, store: DictStore | None = None
) -> ColocatedEngine:
    engine = ColocatedEngine.from_model_dir(
        tiny, torch.float64, EngineConfig(page_size=PAGE, num_pages=num_pages)
    )
    if host_pages or store is not None:
        pool = engine.pool
        # recomputing priced at 100 tokens/s: a store answer on a loaded machine is never a miss
        prices = TierPrices(prefill_tokens_per_s=100.0)
        layout, size = pool_block_layout(pool), page_bytes(pool)
        config = TierConfig(host_pages, store, "tiny", layout, size, prices=prices, secret=b"a secret")
        engine.attach_tiers(build_tiers(pool, config)[1])
    return engine


def test_host_and_store_hits_give_the_tokens_of_an_engine_without_tiers(tiny: Path) -> None:
    rng = random.Random(0)
    shared = [rng.randrange(256) for _ in range(4 * PAGE)]
    fillers = [[rng.randrange(256) for _ in range(5 * PAGE)] for _ in range(2)]
    again = shared + [rng.randrange(256) for _ in range(3)]
    greedy = SamplingParams(max_tokens=5, ignore_eos=True)
    want = _engine(tiny, 256).generate([[*shared, 1], *fillers, again], greedy)

    store = DictStore()
    engine = _engine(tiny, num_pages=8, host_pages=32, store=store)
    got = [engine.generate([p], greedy)[0] for p in ([*shared, 1], *fillers)]  # one at a time: evicts
    (from_host,) = engine.generate([again], greedy)
    assert [o.token_ids for o in [*got, from_host]] == [o.token_ids for o in want]
    assert from_host.cached_tokens == 4 * PAGE
    assert engine.copier is not None and engine.copier.tiers.host_load_bytes > 0
    engine.copier.tiers.writer.flush()

    other = _engine(tiny, num_pages=16, store=store)  # another rank: nothing on its device
    (from_store,) = other.generate([again], greedy)
    assert from_store.token_ids == want[-1].token_ids and from_store.cached_tokens == 4 * PAGE
    assert other.copier is not None and other.copier.tiers.store_load_bytes > 0
    for e in (engine, other):
        e.scheduler.check_integrity()
        e.copier.tiers.close()
