from __future__ import annotations

import random

import pytest

from tandem.bench.tier_cache import RankTiers, SharedStore, TierSpeeds
from tandem.router.index import BlockIndex, TierMatch
from tandem.wire.kv_events import BlockRemoved, BlockStored


def test_a_device_eviction_goes_to_the_host_and_a_host_hit_comes_back() -> None:
    rank = RankTiers(capacity_blocks=3, host_capacity_blocks=2)
    assert rank.complete([1, 2, 3], computed_from=0) == [BlockStored((1, 2, 3), None, 512)]
    events = rank.complete([7, 8], computed_from=0)
    assert events[-2:] == [BlockRemoved((1, 2), "device"), BlockStored((1, 2), None, 512, "host")]
    assert rank.match([1, 2, 3]) == TierMatch(device=1, host=2)  # 1, 2 on the host, 3 on the device
    assert rank.match([9, 7]) == TierMatch()  # the run ends at the first block in no tier
    events = rank.complete([1, 2, 3], computed_from=2)  # the host's 1, 2 move back to the device
    assert events[0] == BlockRemoved((1, 2), "host")
    assert rank.num_blocks("device") == 3 and rank.num_blocks("host") == 2  # 7, 8 went down


def test_the_store_takes_what_ranks_compute_and_every_rank_reads_it() -> None:
    store = SharedStore(capacity_blocks=3)
    one, two = RankTiers(4, 0, store), RankTiers(4, 0, store)
    events = one.complete([1, 2, 3], computed_from=1)  # 1 was loaded: only 2 and 3 are written
    assert BlockStored((2, 3), 1, 512, "store") in events
    assert two.match([1, 2, 3]) == TierMatch(store=0)  # 1 is not in the store: the run is empty
    two.complete([1, 2], computed_from=0)
    assert one.match([1, 2, 3]) == TierMatch(device=3)
    events = two.complete([4], computed_from=0)  # the store holds 3: its least recent goes
    assert events[-1] == BlockRemoved((2,), "store")
    assert two.match([1, 2]) == TierMatch(device=2)


def test_the_index_fed_the_tiers_events_predicts_each_ranks_match() -> None:
    """Random prompts over two ranks with host tiers and a bounded store: what the router's
    index predicts from the events is what each rank finds, tier by tier."""
    rng = random.Random(5)
    store = SharedStore(capacity_blocks=30)
    ranks = {"r0": RankTiers(8, 12, store), "r1": RankTiers(6, 0, store)}
    index: BlockIndex[str] = BlockIndex()
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(2, 12))] for _ in range(6)]
    for _ in range(300):
        name = rng.choice(list(ranks))
        prompt = [*rng.choice(prefixes)[: rng.randrange(1, 12)], rng.randrange(1000, 2000)]
        for other, rank in ranks.items():
            assert index.match_tiers(prompt).get(other) == rank.match(prompt)
        found = ranks[name].match(prompt)
        index.apply_all(name, ranks[name].complete(prompt, computed_from=found.blocks))
        index.check_integrity()
        assert index.block_counts("host").get(name, 0) == ranks[name].num_blocks("host")
        assert index.num_store_blocks == len(store)


def test_speeds_price_each_tier_and_the_rank_loads_only_what_is_faster() -> None:
    speeds = TierSpeeds(6_000.0, host_load_tokens_per_s=300_000.0, store_load_tokens_per_s=3_000.0)
    assert speeds.cost("device") == 0.0 and speeds.cost("host") == pytest.approx(0.02)
    assert speeds.loads("host") and not speeds.loads("store")
    assert speeds.service_s(6_000, TierMatch(device=4, host=1)) == pytest.approx(1.0 + 512 / 300_000)
    with pytest.raises(ValueError, match="--store-load-tokens-per-s"):
        TierSpeeds(6_000.0, store_load_tokens_per_s=0.0)
