from __future__ import annotations

import math

import pytest

from tandem.router.decode_choice import DecodeCandidate, choose_decode_rank
from tandem.router.policy import (
    DEFAULT_HOST_LOAD_COST,
    PolicyConfig,
    PrefillCandidate,
    PrefillQuery,
    load_cost,
)
from tandem.router.registry import PREFILL_POLICIES, UnknownPolicy, make_prefill_policy

PAGE = 16
# 10 full pages + 1 token: 10 reusable blocks
QUERY = PrefillQuery(num_prompt_tokens=10 * PAGE + 1, num_blocks=10, max_reusable_blocks=10, page_size=PAGE)


def cand(rank: str, matched: int = 0, in_flight: int = 0, routed: int = 0) -> PrefillCandidate:
    return PrefillCandidate(rank, matched, in_flight, routed, cached_blocks=0)


def test_registry_names_and_config_checks() -> None:
    assert {"cache_aware", "round_robin", "least_loaded"} <= set(PREFILL_POLICIES)
    for name, policy in PREFILL_POLICIES.items():
        made = make_prefill_policy(name)
        assert isinstance(made, policy) and made.name == name and made.branches
    with pytest.raises(UnknownPolicy, match="cache_aware"):
        make_prefill_policy("random")
    for bad in (
        {"cache_threshold": 1.5},
        {"balance_rel_threshold": 0.5},
        {"load_weight": -1.0},
        {"balance_abs_threshold_tokens": -1},
    ):
        with pytest.raises(ValueError):
            PolicyConfig(**bad)


def test_round_robin_takes_turns_blind_to_caches() -> None:
    policy = make_prefill_policy("round_robin")
    candidates = [cand("a", matched=9), cand("b"), cand("c")]
    assert [policy.choose(QUERY, candidates).rank for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_loaded_breaks_ties_by_tokens_given_so_far() -> None:
    policy = make_prefill_policy("least_loaded")
    assert policy.choose(QUERY, [cand("a", in_flight=5), cand("b", in_flight=3)]).rank == "b"
    tied = [cand("a", routed=900), cand("b", routed=100), cand("c", routed=500)]
    assert policy.choose(QUERY, tied).rank == "b"


def test_cache_aware_sends_a_new_prompt_to_the_least_loaded_rank() -> None:
    policy = make_prefill_policy("cache_aware", PolicyConfig(cache_threshold=0.3))
    # 2 of 10 blocks is below the threshold: a new conversation.
    choice = policy.choose(QUERY, [cand("a", matched=2, in_flight=100), cand("b", in_flight=50)])
    assert (choice.rank, choice.branch) == ("b", "low_match")
    choice = policy.choose(QUERY, [cand("a", in_flight=100), cand("b", in_flight=50)])
    assert (choice.rank, choice.branch) == ("b", "low_match")


def test_cache_aware_follows_the_longest_match_unless_the_queue_outweighs_it() -> None:
    config = PolicyConfig(cache_threshold=0.3, load_weight=0.5, balance_abs_threshold_tokens=10**6)
    policy = make_prefill_policy("cache_aware", config)
    # a saves 8 pages (128 tokens) but queues 200 more tokens: 128 - 100 > 0 - 0
    choice = policy.choose(QUERY, [cand("a", matched=8, in_flight=200), cand("b")])
    assert (choice.rank, choice.branch) == ("a", "cache_hit")
    # with 300 more: 128 - 150 < 0, so the empty rank wins
    assert policy.choose(QUERY, [cand("a", matched=8, in_flight=300), cand("b")]).rank == "b"
    # equal matches: the less loaded one
    assert policy.choose(QUERY, [cand("a", 5, in_flight=9), cand("b", 5, in_flight=8)]).rank == "b"


def test_cache_aware_skips_an_overloaded_rank() -> None:
    config = PolicyConfig(
        cache_threshold=0.3, load_weight=0.0, balance_abs_threshold_tokens=1000, balance_rel_threshold=2.0
    )
    policy = make_prefill_policy("cache_aware", config)
    busy = cand("a", matched=9, in_flight=5000)
    choice = policy.choose(QUERY, [busy, cand("b", matched=4, in_flight=100), cand("c", in_flight=0)])
    assert (choice.rank, choice.branch) == ("b", "balance")  # the best match among the rest
    # Not overloaded when the excess is under the absolute or the relative threshold.
    assert policy.choose(QUERY, [cand("a", 9, in_flight=900), cand("b", 4)]).branch == "cache_hit"
    assert policy.choose(QUERY, [cand("a", 9, in_flight=5000), cand("b", 4, 3000)]).rank == "a"


def test_decode_choice_prefers_room_then_fewest_requests() -> None:
    ranks = [
        DecodeCandidate("d-r0", num_requests=1, free_pages=5),
        DecodeCandidate("d-r1", num_requests=4, free_pages=50),
        DecodeCandidate("d-r2", num_requests=2, free_pages=60),
    ]
    assert choose_decode_rank(ranks, pages_needed=10).rank == "d-r2"
    assert choose_decode_rank(ranks, pages_needed=5).rank == "d-r0"
    assert choose_decode_rank(ranks, pages_needed=100).rank == "d-r2"  # none has room: most free
    fresh = DecodeCandidate("d-r3", num_requests=0, free_pages=math.inf)
    assert choose_decode_rank([*ranks, fresh], pages_needed=10**6).rank == "d-r3"


def tiered(
    rank: str,
    device: int = 0,
    host: int = 0,
    store: int = 0,
    in_flight: int = 0,
    host_load_cost: float = DEFAULT_HOST_LOAD_COST,
) -> PrefillCandidate:
    """A candidate whose run of ``device + host + store`` blocks is split by tier."""
    run = device + host + store
    return PrefillCandidate(
        rank, run, in_flight, 0, device, host_blocks=host, store_blocks=store, host_load_cost=host_load_cost
    )


def test_default_tier_prices_follow_the_bandwidth_arithmetic() -> None:
    # DeepSeek-V3's 70,272-byte tokens at 6,000 tokens/s: 25 GB/s from host, 5 GB/s from the store
    assert load_cost(25e9, 6_000, 70_272) == pytest.approx(0.0169, abs=1e-4)
    assert PolicyConfig().host_load_cost == pytest.approx(load_cost(25e9, 6_000, 70_272))
    assert PolicyConfig().store_load_cost == pytest.approx(0.0843, abs=1e-4)
    assert PolicyConfig().host_load_cost < PolicyConfig().store_load_cost < 1.0
    with pytest.raises(ValueError, match="store_load_cost"):
        PolicyConfig(store_load_cost=-0.1)
    with pytest.raises(ValueError, match="in a run of 2"):
        PrefillCandidate("a", 2, 0, 0, 0, host_blocks=2, store_blocks=1)


def test_at_equal_load_device_beats_host_beats_store_only() -> None:
    policy = make_prefill_policy("cache_aware")
    device, host, store = tiered("c", device=8), tiered("b", host=8), tiered("a", store=8)
    assert device.saved_blocks() > host.saved_blocks() > store.saved_blocks() > 0
    choice = policy.choose(QUERY, [store, host, device])
    assert (choice.rank, choice.branch) == ("c", "cache_hit")
    assert policy.choose(QUERY, [store, host]).rank == "b"
    # the same run, one part on the device: that rank saves more
    assert policy.choose(QUERY, [tiered("a", 2, 6), tiered("b", 1, 7)]).rank == "a"
    # every rank reads the store: a store-only run is a tie that load decides
    assert policy.choose(QUERY, [tiered("a", store=8, in_flight=9), tiered("b", store=8)]).rank == "b"


def test_a_tier_priced_slower_than_compute_saves_nothing() -> None:
    policy = make_prefill_policy("cache_aware", PolicyConfig(load_weight=0.5))
    slow = tiered("a", host=8, in_flight=1, host_load_cost=1.5)
    assert slow.saved_blocks() == 0.0
    # its run still counts as a match (not a new conversation), but it saves nothing: load decides
    choice = policy.choose(QUERY, [slow, tiered("b", in_flight=0)])
    assert (choice.rank, choice.branch) == ("b", "cache_hit")
    busy_idle = [tiered("a", host=8, host_load_cost=1.5), tiered("b", store=1, in_flight=2)]
    assert policy.choose(QUERY, busy_idle).rank == "b"
    # a fast store beats a host tier priced at 0.9 for the same run
    assert policy.choose(QUERY, [tiered("a", host=8, host_load_cost=0.9), tiered("b", store=8)]).rank == "b"


def test_the_low_match_threshold_counts_the_whole_usable_run() -> None:
    policy = make_prefill_policy("cache_aware", PolicyConfig(cache_threshold=0.3))
    # 1 device block alone is under 30% of 10; with 3 store blocks behind it, it is a match
    assert policy.choose(QUERY, [tiered("a", device=1), tiered("b")]).branch == "low_match"
    assert policy.choose(QUERY, [tiered("a", device=1, store=3), tiered("b", store=0)]).branch == "cache_hit"
