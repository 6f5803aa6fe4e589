"""The router keyed by rank names and keyed by ``RankId``s decides alike (``router.rank_key``)."""

from __future__ import annotations

import zlib
from collections.abc import Mapping, Sequence

import pytest

from tandem.router.rank_key import K
from tandem.router.registry import PREFILL_POLICIES
from tandem.router.router import RouteDecision, Router, RouterConfig
from tandem.wire.kv_events import AllBlocksCleared, BlockStored
from tandem.wire.messages import RankId

PAGE = 4
# Fewer than 10 ranks a group: here a RankId's order and its name's order agree.
PREFILL = [RankId("prefill0", 0), RankId("prefill0", 1), RankId("prefill0", 2), RankId("prefill1", 0)]
DECODE = [RankId("decode0", 0), RankId("decode0", 1), RankId("decode1", 0)]
# "" is name order; each other salt sends the first idle request to a rank other than the first
SALTS = ("", "tandem-frontend-1", "tandem-frontend-2")


def names(ranks: Sequence[RankId]) -> list[str]:
    return [rank.name for rank in ranks]


def by_name(values: Mapping[K, int]) -> dict[str, int]:
    named = {str(rank): value for rank, value in values.items()}
    assert len(named) == len(values)
    return named


def scenario(router: Router[K], prefill: Sequence[K], decode: Sequence[K]) -> list[object]:
    """Drive ``router`` through joins, reports, events, routes and a leave; return what it said
    at each step with every rank written as its name."""
    seen: list[object] = []
    p0, p1, p2, p3 = prefill
    d0, d1, d2 = decode

    def route(request_id: str, hashes: list[int], tokens: int, max_new: int = 8) -> RouteDecision[K]:
        decision = router.route(request_id, hashes, tokens, PAGE, max_new)
        seen.append(
            (
                "route",
                request_id,
                str(decision.prefill_rank),
                str(decision.decode_rank),
                decision.matched_blocks,
                decision.predicted_cached_tokens,
                decision.branch,
                decision.decode_pages,
            )
        )
        return decision

    def state() -> None:
        loads = router.loads()
        seen.append(
            (
                "state",
                [str(rank) for rank in router.prefill_ranks],
                [str(rank) for rank in router.decode_ranks],
                by_name(loads.prefill_tokens),
                by_name(loads.decode_requests),
                by_name(loads.decode_promised_pages),
                by_name(router.cached_blocks()),
                router.counters(),
                router.num_in_flight,
            )
        )
        router.check_integrity()

    router.set_ranks(list(reversed(prefill)), [d2, d0, d1])  # the router orders them itself
    state()
    # All idle and no reports: every choice is a tie, which the salt (or the rank order) breaks.
    route("idle-a", [], 3)
    route("idle-b", [1], 5)
    router.update_decode_stats(d0, free_pages=50, running=1, total_pages=100)
    router.update_decode_stats(d1, free_pages=10, running=0, total_pages=100)
    router.update_decode_stats(d2, free_pages=200, running=3, total_pages=200)
    router.apply_events(p1, [BlockStored((1, 2, 3, 4), None, PAGE)])
    router.apply_events(p2, [BlockStored((1, 2), None, PAGE)])
    router.apply_events(p3, [BlockStored((7,), None, PAGE), AllBlocksCleared()])
    hit = route("hit", [1, 2, 3, 4, 5], 21)
    route("capped", [1, 2, 3, 4], 16, max_new=300)
    route("long", [1, 2], 400, max_new=1)
    state()
    router.prefill_done("hit")
    router.prefill_done("idle-a")
    router.update_decode_stats(hit.decode_rank, free_pages=40, running=2, total_pages=100)
    router.update_prefill_stats(p0, 1000)
    state()
    route("busy", [1, 2, 3, 4, 6], 21)
    # p1 (holding the longest prefix) and d2 leave: their late events and reports are dropped.
    router.set_ranks([p0, p2, p3], [d0, d1])
    router.apply_events(p1, [BlockStored((1, 2, 3, 4, 5), None, PAGE)])
    router.update_decode_stats(d2, free_pages=0, running=0, total_pages=10)
    router.update_prefill_stats(p1, 5)
    state()
    route("after", [1, 2, 3, 4, 5], 21)
    route("new", [9, 8], 9)
    seen.append(("match", by_name(router.match([1, 2, 3]))))
    for request_id in ("idle-a", "idle-b", "hit", "capped", "long", "busy", "after"):
        router.finished(request_id)
    router.abort("new")
    state()
    return seen


@pytest.mark.parametrize("salt", SALTS)
@pytest.mark.parametrize("policy", sorted(PREFILL_POLICIES))
def test_names_and_rank_ids_make_the_same_decisions(policy: str, salt: str) -> None:
    config = RouterConfig(policy=policy, tie_break_salt=salt)
    keyed_by_id = Router[RankId](config)
    with_ids = scenario(keyed_by_id, PREFILL, DECODE)
    with_names = scenario(Router(config), names(PREFILL), names(DECODE))
    assert with_ids == with_names
    assert all(type(rank) is RankId for rank in keyed_by_id.prefill_ranks + keyed_by_id.decode_ranks)
    assert set(keyed_by_id.loads().decode_requests) == {DECODE[0], DECODE[1]}  # DECODE[2] left


@pytest.mark.parametrize("salt", SALTS[1:])
def test_a_salted_tie_break_hashes_the_rank_name(salt: str) -> None:
    """Idle ranks tie; the salt orders them by the CRC of ``salt/name``, a RankId's too."""

    def first(ranks: Sequence[RankId]) -> RankId:
        return min(ranks, key=lambda rank: zlib.crc32(f"{salt}/{rank.name}".encode()))

    router = Router[RankId](RouterConfig(tie_break_salt=salt))
    router.set_ranks(PREFILL, DECODE)
    decision = router.route("a", [], 3, PAGE, 1)
    assert (decision.prefill_rank, decision.decode_rank) == (first(PREFILL), first(DECODE))
    assert decision.prefill_rank != PREFILL[0]  # not the rank order: the salt decided


def test_rank_ids_order_by_number_where_names_order_by_characters() -> None:
    """The one difference between the keys: from 10 ranks a group, names sort "r10" before "r2"
    and RankIds do not. Unsalted ties go to the first rank in that order."""
    ids = [RankId("prefill0", 2), RankId("prefill0", 10)]
    keyed_by_id = Router[RankId]()
    keyed_by_id.set_ranks(ids, ids)
    keyed_by_name = Router()
    keyed_by_name.set_ranks(names(ids), names(ids))
    assert names(keyed_by_id.prefill_ranks) == ["prefill0-r2", "prefill0-r10"]
    assert keyed_by_name.prefill_ranks == ["prefill0-r10", "prefill0-r2"]
    decision = keyed_by_id.route("a", [], 3, PAGE, 1)
    assert (decision.prefill_rank, decision.decode_rank) == (ids[0], ids[0])
    decision_by_name = keyed_by_name.route("a", [], 3, PAGE, 1)
    assert (decision_by_name.prefill_rank, decision_by_name.decode_rank) == ("prefill0-r10", "prefill0-r10")
