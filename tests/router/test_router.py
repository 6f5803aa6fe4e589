from __future__ import annotations

import math
import time
from collections.abc import Sequence

import pytest

from tandem.engine.prefix_cache import block_hashes
from tandem.router.index import TierMatch
from tandem.router.policy import PolicyConfig, PrefillCandidate, PrefillChoice, PrefillPolicy, PrefillQuery
from tandem.router.router import DuplicateRequestId, NoRankAvailable, RouteDecision, Router, RouterConfig
from tandem.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

PAGE = 4
PREFILL = ["prefill0-r0", "prefill0-r1", "prefill1-r0"]
DECODE = ["decode0-r0", "decode0-r1"]


def make_router(**policy: object) -> Router:
    router = Router(RouterConfig(policy_config=PolicyConfig(**policy)))  # type: ignore[arg-type]
    router.set_ranks(PREFILL, DECODE)
    return router


def store(router: Router, rank: str, tokens: list[int]) -> None:
    router.apply_events(rank, [BlockStored(tuple(block_hashes(tokens, PAGE)), None, PAGE)])


def route(router: Router, request_id: str, tokens: list[int], max_new_tokens: int = 8) -> RouteDecision:
    return router.route(request_id, block_hashes(tokens, PAGE), len(tokens), PAGE, max_new_tokens)


def test_routes_to_the_rank_holding_the_prefix_and_predicts_the_ranks_rule() -> None:
    router = make_router()
    prefix = list(range(16))  # 4 pages
    store(router, "prefill0-r1", prefix)
    store(router, "prefill1-r0", prefix[:8])
    decision = route(router, "a", [*prefix, 99, 98])
    assert decision.prefill_rank == "prefill0-r1" and decision.branch == "cache_hit"
    assert (decision.matched_blocks, decision.predicted_cached_tokens) == (4, 16)
    # Exactly 4 pages: the last token must be computed, so only 3 pages can be reused.
    capped = route(router, "b", prefix)
    assert capped.prefill_rank == "prefill0-r1"
    assert (capped.matched_blocks, capped.predicted_cached_tokens) == (3, 12)
    assert router.loads().prefill_tokens == {"prefill0-r0": 0, "prefill0-r1": 2 + 4, "prefill1-r0": 0}
    assert router.counters()["matched_blocks"] == 7 and router.counters()["queried_blocks"] == 8
    router.check_integrity()


def test_a_new_prompt_goes_to_the_least_loaded_rank_and_load_drains() -> None:
    router = make_router()
    first = route(router, "a", list(range(100, 140)))
    second = route(router, "b", list(range(200, 210)))
    assert first.branch == second.branch == "low_match"
    assert first.prefill_rank != second.prefill_rank
    assert first.decode_rank != second.decode_rank
    assert router.loads().prefill_tokens[first.prefill_rank] == 40
    router.prefill_done("a")
    router.prefill_done("a")
    assert router.loads().prefill_tokens[first.prefill_rank] == 0
    assert router.loads().decode_requests[first.decode_rank] == 1
    router.finished("a")
    router.abort("b")
    router.finished("b")
    assert router.num_in_flight == 0
    assert all(v == 0 for v in router.loads().decode_promised_pages.values())
    router.check_integrity()


def test_counters_count_each_decision_once() -> None:
    router = make_router()
    store(router, "prefill0-r0", list(range(12)))
    for number in range(5):
        route(router, f"r{number}", [*range(12), number])
        router.finished(f"r{number}")
    route(router, "new", list(range(50, 60)))
    counters = router.counters()
    assert counters["requests_routed"] == 6
    assert counters["branch_cache_hit"] == 5 and counters["branch_low_match"] == 1
    assert counters["matched_blocks"] == 5 * 3 and counters["queried_blocks"] == 5 * 3 + 2
    assert counters["events_applied"] == 1
    router.check_integrity()


def test_no_rank_and_duplicate_ids_are_typed_errors() -> None:
    router = Router()
    with pytest.raises(NoRankAvailable, match="prefill") as err:
        route(router, "a", [1, 2, 3])
    assert err.value.role == "prefill"
    router.set_ranks(PREFILL, [])
    with pytest.raises(NoRankAvailable, match="decode"):
        route(router, "a", [1, 2, 3])
    router.set_ranks(PREFILL, DECODE)
    route(router, "a", [1, 2, 3])
    with pytest.raises(DuplicateRequestId):
        route(router, "a", [1, 2, 3])
    with pytest.raises(ValueError, match="block hashes"):
        router.route("b", [1, 2], 7, PAGE, 1)
    with pytest.raises(ValueError):
        router.route("b", [], 0, PAGE, 1)
    router.check_integrity()


def test_a_rank_that_leaves_is_forgotten_and_its_late_events_dropped() -> None:
    router = make_router()
    prefix = list(range(20))
    store(router, "prefill0-r1", prefix)
    decision = route(router, "a", prefix)
    assert decision.prefill_rank == "prefill0-r1"
    router.set_ranks(["prefill0-r0", "prefill1-r0"], DECODE)
    assert "prefill0-r1" not in router.loads().prefill_tokens
    store(router, "prefill0-r1", prefix)  # late
    assert router.counters()["events_dropped"] == 1
    assert router.match(block_hashes(prefix, PAGE)) == {}
    router.prefill_done("a")  # its rank left: a no-op
    router.finished("a")
    assert route(router, "b", prefix).branch == "low_match"
    router.apply_events("prefill0-r0", [AllBlocksCleared()])
    router.check_integrity()


def test_decode_stats_steer_requests_to_the_rank_with_room() -> None:
    router = make_router()
    router.update_decode_stats("decode0-r0", free_pages=3, running=0, total_pages=100)
    router.update_decode_stats("decode0-r1", free_pages=100, running=9, total_pages=200)
    small = route(router, "small", list(range(7)), max_new_tokens=1)  # 2 pages
    assert small.decode_rank == "decode0-r0" and small.decode_pages == 2  # fewer running
    big = route(router, "big", list(range(40)), max_new_tokens=1000)  # 40 + 256 reserved = 74 pages
    assert big.decode_pages == 74 and big.decode_rank == "decode0-r1"
    # decode0-r0 has 3 - 2 promised = 1 page left; a 2-page request no longer fits there.
    assert route(router, "next", list(range(7)), max_new_tokens=1).decode_rank == "decode0-r1"
    # Room nowhere (1 and 100 - 76 = 24 pages left): the most free pages; the rank queues it.
    assert route(router, "huge", list(range(400)), max_new_tokens=1).decode_rank == "decode0-r1"
    assert router.loads().decode_promised_pages == {"decode0-r0": 2, "decode0-r1": 74 + 2 + 101}
    # A report after their prefills counts their pages: the promises go.
    for request_id in ("small", "big", "next", "huge"):
        router.prefill_done(request_id)
    router.update_decode_stats("decode0-r1", free_pages=10, running=12, total_pages=200)
    assert router.loads().decode_promised_pages == {"decode0-r0": 2, "decode0-r1": 0}
    router.check_integrity()


class _Fixed(PrefillPolicy):
    name = "fixed"
    branches = ("fixed",)

    def choose(self, query: PrefillQuery, candidates: Sequence[PrefillCandidate]) -> PrefillChoice:
        return PrefillChoice("nowhere", "fixed")


def test_a_policy_choosing_an_unknown_rank_is_refused() -> None:
    router = Router(policy=_Fixed(PolicyConfig()))
    router.set_ranks(PREFILL, DECODE)
    with pytest.raises(ValueError, match="nowhere"):
        route(router, "a", [1, 2, 3])
    assert router.num_in_flight == 0
    router.check_integrity()


def test_routing_takes_microseconds() -> None:
    router = Router()
    router.set_ranks([f"prefill0-r{i}" for i in range(16)], DECODE)
    hashes = list(range(64))
    for i in range(16):
        router.apply_events(f"prefill0-r{i}", [BlockStored(tuple(hashes[: 4 * i]), None, PAGE)])
    start = time.perf_counter()
    for number in range(1000):
        router.route(f"r{number}", hashes, 64 * PAGE + 1, PAGE, 16)
        router.finished(f"r{number}")
    per_route_s = (time.perf_counter() - start) / 1000
    assert per_route_s < 1e-3  # about 30 us here; generous for slow CI machines
    router.check_integrity()


def test_a_prefill_ranks_report_counts_other_frontends_load() -> None:
    """Two frontends' routers: what one sent is invisible to the other until the rank reports
    it; with the report the other router routes around the busy rank."""
    one, two = make_router(), make_router()
    first = route(one, "a", list(range(40)))
    blind = route(two, "b", list(range(100, 140)))
    assert blind.prefill_rank == first.prefill_rank  # no report yet: both picked the same rank
    two.finished("b")
    two.update_prefill_stats(first.prefill_rank, 40)  # the rank's own count, both frontends'
    informed = route(two, "c", list(range(200, 240)))
    assert informed.prefill_rank != first.prefill_rank
    # a report below what this router has in flight there does not hide its own load
    two.update_prefill_stats(informed.prefill_rank, 0)
    assert route(two, "d", list(range(300, 340))).prefill_rank not in (informed.prefill_rank,)
    two.check_integrity()


def test_routers_of_different_frontends_break_ties_in_their_own_orders() -> None:
    """Idle ranks tie; each frontend's router orders them by its own salt, so frontends that see
    the same loads do not all send their next request to the same rank."""
    firsts = set()
    for name in ("tandem-frontend-0", "tandem-frontend-1", "tandem-frontend-2", "tandem-frontend-3"):
        router = Router(RouterConfig(tie_break_salt=name))
        router.set_ranks(PREFILL, DECODE)
        decision = route(router, "a", list(range(20)))
        again = Router(RouterConfig(tie_break_salt=name))
        again.set_ranks(PREFILL, DECODE)
        assert route(again, "a", list(range(20))) == decision  # the order is the router's own, and fixed
        firsts.add((decision.prefill_rank, decision.decode_rank))
    assert len(firsts) > 1
    unsalted = make_router()
    assert route(unsalted, "a", list(range(20))).prefill_rank == PREFILL[0]  # name order without a salt


def test_a_bad_prefill_report_is_refused() -> None:
    router = make_router()
    with pytest.raises(ValueError, match="pending_tokens=-1"):
        router.update_prefill_stats(PREFILL[0], -1)
    router.update_prefill_stats("gone-r0", 5)  # a rank that left: ignored
    router.check_integrity()


def test_colocated_ranks_decode_where_the_policy_sends_the_prompt() -> None:
    ranks = ["colocated0-r0", "colocated0-r1"]
    router = Router()
    router.set_ranks(ranks, ranks)
    router.update_decode_stats("colocated0-r0", free_pages=100, running=0, total_pages=100)
    router.update_decode_stats("colocated0-r1", free_pages=3, running=9, total_pages=100)
    store(router, "colocated0-r1", list(range(16)))
    held = router.route("a", block_hashes([*range(16), 7], PAGE), 17, PAGE, 8, same_rank=True)
    # the decode choice alone would take r0 (room, fewer requests); the prompt's cache is on r1
    assert held.prefill_rank == held.decode_rank == "colocated0-r1" and held.branch == "cache_hit"
    assert router.loads().decode_promised_pages == {"colocated0-r0": 0, "colocated0-r1": held.decode_pages}
    apart = route(router, "b", [*range(16), 7])
    assert (apart.prefill_rank, apart.decode_rank) == ("colocated0-r1", "colocated0-r0")
    router.check_integrity()


def test_tiered_events_steer_routing_and_the_decision_splits_the_prediction() -> None:
    router = make_router(load_weight=0.0)
    prefix = list(range(16))  # 4 pages
    hashes = tuple(block_hashes(prefix, PAGE))
    router.apply_events("prefill0-r0", [BlockStored(hashes[:1], None, PAGE, "store")])
    router.apply_events("prefill0-r1", [BlockStored(hashes, None, PAGE)])
    router.apply_events(
        "prefill0-r1", [BlockRemoved(hashes[2:], "device"), BlockStored(hashes[2:], None, PAGE, "host")]
    )
    decision = route(router, "a", [*prefix, 5])
    assert decision.prefill_rank == "prefill0-r1"  # 2 device + 2 host pages beat the store's 1
    assert decision.matched_by_tier == TierMatch(device=2, host=2)
    assert (decision.matched_blocks, decision.predicted_cached_tokens) == (4, 16)
    assert router.match(hashes) == {"prefill0-r0": 1, "prefill0-r1": 4, "prefill1-r0": 1}
    assert router.match_tiers(hashes)["prefill1-r0"] == TierMatch(store=1)
    # the rank's load is its work in compute tokens: 1 new token and 8 host tokens at their price
    host_cost, _ = router.tier_costs("prefill0-r1")
    assert router.loads().prefill_tokens["prefill0-r1"] == 17 - math.floor(16 - 8 * host_cost)
    assert router.counters()["matched_host_blocks"] == 2
    # measured on the rank: its host tier is slower than recomputing, so its host pages save
    # nothing; its 2 device pages still beat the others' store page, and the rank computes 9 tokens
    router.prefill_done("a")
    router.set_tier_costs("prefill0-r1", host=1.2)
    again = route(router, "b", [*prefix, 6])
    assert again.prefill_rank == "prefill0-r1" and again.matched_by_tier == TierMatch(device=2, host=2)
    assert router.loads().prefill_tokens["prefill0-r1"] == 17 - 8
    router.apply_events("prefill0-r1", [BlockRemoved(hashes[:2], "device")])  # only the store run is left
    third = route(router, "c", [*prefix, 7])
    assert third.prefill_rank != "prefill0-r1" and third.matched_by_tier == TierMatch(store=1)
    assert router.cached_blocks("host") == {"prefill0-r0": 0, "prefill0-r1": 2, "prefill1-r0": 0}
    router.check_integrity()


def test_tier_speeds_become_prices_and_fall_back_to_the_defaults() -> None:
    router = make_router()
    defaults = (PolicyConfig().host_load_cost, PolicyConfig().store_load_cost)
    assert router.tier_costs("prefill0-r0") == defaults
    router.set_tier_speeds("prefill0-r0", 50e9, 0.0, 6_000.0, 70_272)  # store not measured yet
    host, store = router.tier_costs("prefill0-r0")
    assert host == pytest.approx(70_272 * 6_000 / 50e9) and store == defaults[1]
    with pytest.raises(ValueError, match="tier costs"):
        router.set_tier_costs("prefill0-r0", host=-1.0)
    router.set_tier_costs("gone-r0", host=0.5)  # not a prefill rank: ignored
    assert router.tier_costs("gone-r0") == defaults
    router.set_ranks(PREFILL[1:], DECODE)
    router.set_ranks(PREFILL, DECODE)
    assert router.tier_costs("prefill0-r0") == defaults  # a rank that left starts over


def test_a_pinned_decode_rank_is_taken_while_it_is_in_the_view() -> None:
    """A forked choice goes to its parent's decode rank, even the more loaded one, and its load
    counts there; a pinned rank no longer in the view is ignored."""
    router = make_router()
    parent = route(router, "parent", list(range(300, 320)))
    tokens = list(range(300, 320))
    child = router.route(
        "child", block_hashes(tokens, PAGE), len(tokens), PAGE, 8, decode_rank=parent.decode_rank
    )
    assert child.decode_rank == parent.decode_rank
    assert router.loads().decode_requests[parent.decode_rank] == 2
    gone = router.route("gone", block_hashes(tokens, PAGE), len(tokens), PAGE, 8, decode_rank="decode9-r0")
    assert gone.decode_rank in DECODE and gone.decode_rank != parent.decode_rank  # the less loaded
    router.check_integrity()
