"""DeepSeek-V4's state in the host tier and the store: a prefix evicted from the device comes
back from the host with every kind of its state (entries, indexer keys, and on the pages that
keep it, the window KV and overlap a hit restores from), another engine (another rank) reads it
from the store, and the tokens are transformers'. A block that comes without its boundary state
holds its entries only: the hit ends at the last page whose boundary state came with it."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.kv_block_codec import StoredBlock, decode_block, encode_block
from tandem.engine.kv_tiers import TierConfig, TierPrices
from tandem.engine.tier_copier import (
    boundary_bytes,
    boundary_share,
    build_tiers,
    page_bytes,
    pool_block_layout,
)
from tandem.engine.v4_runner import V4Runner
from tandem.wire.block_chain import prompt_chain
from tandem.wire.request_params import SamplingParams
from tests.hf_v4_reference import hf_greedy, hf_v4, lowest_index_ties, write_tiny_v4
from tests.kv_store_double import DictStore

PAGE = 16
NEW_TOKENS = 8
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
SECRET = b"a secret"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("v4-tiers") / "model"
    write_tiny_v4(directory, seed=3, index_topk=3)
    return directory


def _engine(
    model_dir: Path, num_pages: int, host_pages: int = 0, store: DictStore | None = None, share: float = 1.0
) -> ColocatedEngine:
    engine = ColocatedEngine.from_model_dir(
        model_dir, config=EngineConfig(page_size=PAGE, num_pages=num_pages, v4_window_share=share)
    )
    pool = engine.pool
    assert pool is not None
    config = TierConfig(
        host_pages,
        store,
        "tiny-v4",
        pool_block_layout(pool),
        page_bytes(pool),
        boundary_bytes=boundary_bytes(pool),
        boundary_share=boundary_share(pool),
        prices=TierPrices(prefill_tokens_per_s=100.0),  # loading always wins: the test is exactness
        secret=SECRET,
    )
    engine.attach_tiers(build_tiers(pool, config)[1])
    return engine


def _prompts() -> tuple[list[int], list[list[int]], list[int]]:
    rng = random.Random(7)
    shared = [rng.randrange(256) for _ in range(8 * PAGE)]
    fillers = [[rng.randrange(256) for _ in range(6 * PAGE)] for _ in range(2)]
    return shared, fillers, shared + [rng.randrange(256) for _ in range(5)]


def _hf(model_dir: Path, prompt: list[int]) -> list[int]:
    with lowest_index_ties():
        return hf_greedy(hf_v4(model_dir), prompt, NEW_TOKENS)


def test_a_prefix_back_from_the_host_and_from_the_store_gives_transformers_tokens(model_dir: Path) -> None:
    shared, fillers, again = _prompts()
    want = _hf(model_dir, again)
    store = DictStore()
    engine = _engine(model_dir, num_pages=10, host_pages=32, store=store)
    for prompt in ([*shared, 1], *fillers):  # one at a time: the fillers evict the shared pages
        engine.generate([prompt], GREEDY)
    on_device = set(engine.scheduler.kv_cache.cached_block_hashes())
    assert prompt_chain(shared, PAGE)[0].block not in on_device  # the shared prefix left the device
    (from_host,) = engine.generate([again], GREEDY)
    assert from_host.token_ids == want
    assert from_host.cached_tokens == 8 * PAGE
    runner = engine.runner
    assert isinstance(runner, V4Runner) and runner.restores == 1
    tiers = engine.copier.tiers if engine.copier is not None else None
    assert tiers is not None and tiers.host_load_bytes > 0 and tiers.writer is not None
    tiers.writer.flush()

    other = _engine(model_dir, num_pages=24, store=store)  # another rank: nothing on its device
    (from_store,) = other.generate([again], GREEDY)
    assert from_store.token_ids == want and from_store.cached_tokens == 8 * PAGE
    assert other.copier is not None and other.copier.tiers.store_load_bytes > 0
    for e in (engine, other):
        e.scheduler.check_integrity()
        assert e.copier is not None
        e.copier.tiers.close()


def _stored(model_dir: Path, shared: list[int]) -> tuple[DictStore, ColocatedEngine]:
    """A store holding ``shared``'s blocks, written (and flushed) by an engine that served it;
    the store and that engine."""
    store = DictStore()
    writer = _engine(model_dir, num_pages=24, store=store)
    writer.generate([[*shared, 1]], GREEDY)
    assert writer.copier is not None and writer.copier.tiers.writer is not None
    writer.copier.tiers.writer.flush()
    return store, writer


def test_a_block_stored_without_its_boundary_state_ends_the_hit_before_it(model_dir: Path) -> None:
    """The last block's payload re-signed with its entries alone (a page that kept no window KV):
    it is read, but a hit cannot end on it; the hit ends a page earlier, the tokens the same."""
    shared, _, again = _prompts()
    want = _hf(model_dir, again)
    store, writer = _stored(model_dir, shared)
    assert writer.copier is not None
    tiers = writer.copier.tiers
    entries = tiers.config.page_bytes
    assert entries > 0 and tiers.config.boundary_bytes > 0
    last = prompt_chain(shared, PAGE)[-1]
    key = tiers.key(last.block)
    stored = store.values.get(key)
    assert stored is not None and len(stored) > entries + tiers.config.boundary_bytes
    layout = tiers.config.layout
    block = StoredBlock(key, last.parent, last.tokens)
    sizes = (entries, entries + tiers.config.boundary_bytes)
    payload = decode_block(
        stored, secret=SECRET, block=block, model="tiny-v4", layout=layout, payload_bytes=sizes
    )
    store.values[key] = encode_block(SECRET, block, "tiny-v4", layout, payload[:entries])

    reader = _engine(model_dir, num_pages=24, store=store)
    (out,) = reader.generate([again], GREEDY)
    assert out.token_ids == want
    assert out.cached_tokens == 7 * PAGE
    reader.scheduler.check_integrity()
    for e in (writer, reader):
        assert e.copier is not None
        e.copier.tiers.close()


def test_with_a_share_of_pages_keeping_their_window_hits_land_where_it_came_back(model_dir: Path) -> None:
    """At the default share only some pages keep their window KV: the host brings back what was
    kept, the hit ends on such a page, and the tokens are transformers'."""
    shared, fillers, again = _prompts()
    want = _hf(model_dir, again)
    engine = _engine(model_dir, num_pages=12, host_pages=32, share=0.25)
    for prompt in ([*shared, 1], *fillers):
        engine.generate([prompt], GREEDY)
    (out,) = engine.generate([again], GREEDY)
    assert out.token_ids == want
    assert out.cached_tokens % (4 * PAGE) == 0 and out.cached_tokens > 0  # every 4th page keeps it
    assert engine.copier is not None and engine.copier.tiers.host_load_bytes > 0
    engine.scheduler.check_integrity()
    assert engine.copier is not None
    engine.copier.tiers.close()


def test_a_device_run_whose_end_lost_its_window_goes_on_into_the_store(model_dir: Path) -> None:
    """The device holds the first 5 pages of a prefix, the last of them without its window KV
    (its slot taken back): the hit does not stop at the device's last restorable page, it goes
    on through the store's next 3 pages, which carry theirs, and ends there."""
    shared, _, again = _prompts()
    want = _hf(model_dir, again)
    store, writer = _stored(model_dir, shared)

    reader = _engine(model_dir, num_pages=24, store=store)
    reader.generate([shared[: 5 * PAGE]], SamplingParams(max_tokens=1))  # its first 4 pages, then 1
    kv_cache, runner = reader.scheduler.kv_cache, reader.runner
    assert isinstance(runner, V4Runner)
    fifth = prompt_chain(shared, PAGE)[4].block
    page = next(p for p in range(24) if kv_cache.cached_hash(p) == fifth)
    runner.slots.release(page)  # its window KV taken back for another page
    (out,) = reader.generate([again], GREEDY)
    assert out.token_ids == want
    assert out.cached_tokens == 8 * PAGE
    assert reader.copier is not None and reader.copier.tiers.store_load_bytes > 0
    reader.scheduler.check_integrity()
    for e in (writer, reader):
        assert e.copier is not None
        e.copier.tiers.close()
