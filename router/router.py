"""The router a frontend holds: one call per request picks its prefill rank and its decode rank.

::

    set_ranks(prefill, decode)       membership; ranks that leave are forgotten
    apply_events(rank, events)       a prefill rank's KV events (device, host, store) -> BlockIndex
    set_tier_costs(rank, ...)        a prefill rank's measured host and store load prices
    update_decode_stats(rank, ...)   a decode rank's report     -> LoadTracker
    route(request_id, ...)           -> RouteDecision; counts the request's load
    prefill_done / finished / abort  -> drop the load (each idempotent)

Not thread-safe: the frontend calls it from one event loop.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Generic

from tandem.router.decode_choice import DecodeCandidate, choose_decode_rank
from tandem.router.index import BlockIndex, IndexIntegrityError, TieredMatch, TierMatch
from tandem.router.load import LoadTracker
from tandem.router.policy import PolicyConfig, PrefillCandidate, PrefillPolicy, PrefillQuery, load_cost
from tandem.router.rank_key import K
from tandem.router.registry import DEFAULT_POLICY, make_prefill_policy
from tandem.wire.kv_events import KVEvent, Tier


class NoRankAvailable(RuntimeError):
    """No rank of ``role`` is known to the router: start one, or wait for one to join."""

    def __init__(self, role: str) -> None:
        super().__init__(f"no {role} rank is available to route to; add {role} ranks with set_ranks")
        self.role = role


class DuplicateRequestId(ValueError):
    def __init__(self, request_id: str) -> None:
        super().__init__(f"request {request_id!r} is already routed and not finished; ids must be unique")
        self.request_id = request_id


@dataclass(frozen=True)
class RouterConfig:
    policy: str = DEFAULT_POLICY
    policy_config: PolicyConfig = field(default_factory=PolicyConfig)
    # Output tokens a decode rank must have room for beyond the prompt, at most max_new_tokens.
    decode_output_reserve_tokens: int = 256
    # Orders ranks for ties; frontends give each router its own (their names), so that routers
    # that see the same loads do not herd onto one rank. Empty: rank-key order (router.rank_key).
    tie_break_salt: str = ""

    def __post_init__(self) -> None:
        if self.decode_output_reserve_tokens < 0:
            raise ValueError(f"decode_output_reserve_tokens < 0: {self.decode_output_reserve_tokens}")


@dataclass(frozen=True)
class RouteDecision(Generic[K]):
    prefill_rank: K
    decode_rank: K
    matched_blocks: int  # usable run on prefill_rank (all tiers), capped by the one-token rule
    predicted_cached_tokens: int  # matched_blocks * page_size: what the rank's own match will find
    branch: str  # the policy branch that chose prefill_rank
    decode_pages: int  # pages promised on decode_rank
    # matched_blocks by the tier each is loaded from
    matched_by_tier: TierMatch = field(default_factory=TierMatch)


@dataclass(frozen=True)
class RouterLoads(Generic[K]):
    prefill_tokens: dict[K, int]  # in-flight new tokens per prefill rank
    decode_requests: dict[K, int]  # in-flight requests per decode rank
    decode_promised_pages: dict[K, int]


class Router(Generic[K]):
    """Keys ranks by ``K`` (``router.rank_key``): names in tests and the router bench,
    ``RankId`` in the frontend. ``Router()`` is a ``Router[str]``; ``Router[RankId](config)``
    keys by RankId."""

    def __init__(self, config: RouterConfig | None = None, policy: PrefillPolicy[K] | None = None) -> None:
        """``policy`` overrides ``config.policy`` (for a policy that is not registered)."""
        self.config = config or RouterConfig()
        self.policy = policy or make_prefill_policy(self.config.policy, self.config.policy_config)
        self._index: BlockIndex[K] = BlockIndex()
        self._load: LoadTracker[K] = LoadTracker()
        self._prefill_ranks: list[K] = []
        self._prefill_set: frozenset[K] = frozenset()
        self._decode_ranks: list[K] = []
        self._tier_costs: dict[K, tuple[float, float]] = {}  # rank -> measured (host, store) prices
        self._counters: dict[str, int] = dict.fromkeys(
            [
                "requests_routed",
                "matched_blocks",
                "matched_host_blocks",
                "matched_store_blocks",
                "queried_blocks",
                "events_applied",
                "events_dropped",
            ],
            0,
        )
        for branch in self.policy.branches:
            self._counters[f"branch_{branch}"] = 0

    @property
    def prefill_ranks(self) -> list[K]:
        return list(self._prefill_ranks)

    @property
    def decode_ranks(self) -> list[K]:
        return list(self._decode_ranks)

    def set_ranks(self, prefill: Sequence[K], decode: Sequence[K]) -> None:
        """Route to exactly these ranks from now on. A prefill rank that left loses its index
        entries (it must send a fresh snapshot if it returns); any rank that left stops
        counting load."""
        prefill_set = frozenset(prefill)
        for rank in self._prefill_ranks:
            if rank not in prefill_set:
                self._index.remove_rank(rank)
                self._tier_costs.pop(rank, None)
        self._prefill_set = prefill_set
        self._prefill_ranks, self._decode_ranks = sorted(prefill_set), sorted(set(decode))
        self._load.set_ranks(self._prefill_ranks, self._decode_ranks)

    def apply_events(self, rank: K, events: Iterable[KVEvent]) -> None:
        """Apply a prefill rank's events in order. Events of a rank not in the prefill set are
        dropped (late events of a rank that left must not bring it back)."""
        if rank not in self._prefill_set:
            self._counters["events_dropped"] += sum(1 for _ in events)
            return
        for event in events:
            self._index.apply(rank, event)
            self._counters["events_applied"] += 1

    def set_tier_costs(self, rank: K, host: float | None = None, store: float | None = None) -> None:
        """A prefill rank's prices: the time to load one cached token from its host tier and
        from the store, as a fraction of the time it takes to compute one (``None``: the
        config's default, ``PolicyConfig.host_load_cost`` / ``store_load_cost``). Forgotten when
        the rank leaves."""
        policy = self.config.policy_config
        host_cost = policy.host_load_cost if host is None else host
        store_cost = policy.store_load_cost if store is None else store
        if not (host_cost >= 0.0 and store_cost >= 0.0):
            raise ValueError(f"bad tier costs from {rank}: {host=} {store=}")
        if rank in self._prefill_set:
            self._tier_costs[rank] = (host_cost, store_cost)

    def set_tier_speeds(
        self,
        rank: K,
        host_bytes_per_s: float,
        store_bytes_per_s: float,
        prefill_tokens_per_s: float,
        kv_bytes_per_token: int,
    ) -> None:
        """``set_tier_costs`` from a rank's measured speeds (``wire.messages.TierStats``); a
        speed of 0 (not measured yet) keeps the default price of that tier."""

        def cost(bytes_per_s: float) -> float | None:
            if bytes_per_s <= 0 or prefill_tokens_per_s <= 0:
                return None
            return load_cost(bytes_per_s, prefill_tokens_per_s, kv_bytes_per_token)

        self.set_tier_costs(rank, cost(host_bytes_per_s), cost(store_bytes_per_s))

    def tier_costs(self, rank: K) -> tuple[float, float]:
        """The (host, store) prices the router uses for ``rank``."""
        policy = self.config.policy_config
        return self._tier_costs.get(rank, (policy.host_load_cost, policy.store_load_cost))

    def update_decode_stats(self, rank: K, free_pages: int, running: int, total_pages: int) -> None:
        self._load.update_decode_stats(rank, free_pages, running, total_pages)

    def update_prefill_stats(self, rank: K, pending_tokens: int) -> None:
        """A prefill rank's report of its pending prompt tokens (all frontends' requests)."""
        self._load.update_prefill_stats(rank, pending_tokens)

    def route(
        self,
        request_id: str,
        block_hashes: Sequence[int],
        num_prompt_tokens: int,
        page_size: int,
        max_new_tokens: int,
        same_rank: bool = False,
        decode_rank: K | None = None,
    ) -> RouteDecision[K]:
        """Pick both ranks for a request and count its load against them.

        ``block_hashes`` are the chained hashes of the prompt's full pages
        (``engine.prefix_cache.block_hashes``). With ``same_rank`` (colocated ranks, each both
        prefill and decode rank), the decode rank is the prefill rank the policy chose; with
        ``decode_rank`` (a decode rank of the view: a forked choice goes where its parent runs),
        that one. Raises
        ``NoRankAvailable`` when a role has no rank and ``DuplicateRequestId`` when
        ``request_id`` is still in flight.
        """
        self._check_routable(request_id, len(block_hashes), num_prompt_tokens, page_size, max_new_tokens)
        max_reusable = (num_prompt_tokens - 1) // page_size
        matched = self._index.match_tiers(block_hashes[:max_reusable])
        query = PrefillQuery(num_prompt_tokens, len(block_hashes), max_reusable, page_size)
        candidates = self._prefill_candidates(matched)
        choice = self.policy.choose(query, list(candidates.values()))
        chosen = candidates.get(choice.rank)
        if chosen is None:
            raise ValueError(f"policy {self.policy.name} chose {choice.rank!r}, which is not a prefill rank")
        by_tier = matched.get(choice.rank)
        matched_blocks = by_tier.blocks
        cached_tokens = matched_blocks * page_size
        # The rank's work in compute-token units: what it computes, and its loads at their price.
        work_tokens = num_prompt_tokens - math.floor(chosen.saved_blocks() * page_size)

        reserve = min(max_new_tokens, self.config.decode_output_reserve_tokens)
        pages = math.ceil((num_prompt_tokens + reserve) / page_size)
        if same_rank:
            decode_rank = choice.rank
        elif decode_rank is None or decode_rank not in self._decode_ranks:
            candidates_d = [self._decode_candidate(rank) for rank in self._decode_ranks]
            decode_rank = choose_decode_rank(candidates_d, pages).rank

        self._load.add(request_id, choice.rank, work_tokens, decode_rank, pages)
        counters = self._counters
        counters["requests_routed"] += 1
        counters["matched_blocks"] += matched_blocks
        counters["matched_host_blocks"] += by_tier.host
        counters["matched_store_blocks"] += by_tier.store
        counters["queried_blocks"] += len(block_hashes)
        key = f"branch_{choice.branch}"
        counters[key] = counters.get(key, 0) + 1
        return RouteDecision(
            choice.rank, decode_rank, matched_blocks, cached_tokens, choice.branch, pages, by_tier
        )

    def _check_routable(
        self, request_id: str, num_hashes: int, num_prompt_tokens: int, page_size: int, max_new_tokens: int
    ) -> None:
        if num_prompt_tokens < 1 or page_size < 1 or max_new_tokens < 0:
            raise ValueError(f"bad request: {num_prompt_tokens=} {page_size=} {max_new_tokens=}")
        if num_hashes > num_prompt_tokens // page_size:
            full_pages = num_prompt_tokens // page_size
            raise ValueError(f"{num_hashes} block hashes for a prompt of {full_pages} full pages")
        if not self._prefill_ranks:
            raise NoRankAvailable("prefill")
        if not self._decode_ranks:
            raise NoRankAvailable("decode")
        if request_id in self._load:
            raise DuplicateRequestId(request_id)

    def _prefill_candidates(self, matched: TieredMatch[K]) -> dict[K, PrefillCandidate[K]]:
        """Each prefill rank as the policy weighs it: what it holds of the prompt by tier, its
        load, the price of its tiers' loads."""
        load, index = self._load, self._index
        candidates: dict[K, PrefillCandidate[K]] = {}
        for rank in self._prefill_ranks:
            found = matched.get(rank)
            host_cost, store_cost = self.tier_costs(rank)
            candidates[rank] = PrefillCandidate(
                rank,
                found.blocks,
                load.prefill_load(rank),
                load.routed_tokens(rank),
                index.num_blocks(rank),
                self._tie_break(rank),
                found.host,
                found.store,
                host_cost,
                store_cost,
            )
        return candidates

    def prefill_done(self, request_id: str) -> None:
        """The request's prefill finished (or failed): its tokens leave the prefill load."""
        self._load.prefill_done(request_id)

    def finished(self, request_id: str) -> None:
        """The request finished: nothing of it counts any more."""
        self._load.finish(request_id)

    def abort(self, request_id: str) -> None:
        self._load.finish(request_id)

    def counters(self) -> dict[str, int]:
        """``requests_routed``, ``matched_blocks`` (of which ``matched_host_blocks`` and
        ``matched_store_blocks`` from those tiers) and ``queried_blocks`` (totals over routed
        requests), ``events_applied``/``events_dropped``, and ``branch_<name>`` per branch."""
        return dict(self._counters)

    def loads(self) -> RouterLoads[K]:
        return RouterLoads(
            self._load.prefill_loads(),
            self._load.decode_loads(),
            {rank: self._load.promised_pages(rank) for rank in self._decode_ranks},
        )

    def cached_blocks(self, tier: Tier = "device") -> dict[K, int]:
        """Blocks each prefill rank caches in ``tier``, as its events tell (for ``store``, the
        store's blocks, which every rank reads)."""
        return {rank: self._index.num_blocks(rank, tier) for rank in self._prefill_ranks}

    def match(self, block_hashes: Sequence[int]) -> dict[K, int]:
        """Each prefill rank's usable run (uncapped; device, host and store), for ranks with a
        run. With device events only, the leading blocks each rank holds."""
        matched = self._index.match_tiers(block_hashes)
        runs = {rank: matched.get(rank).blocks for rank in self._prefill_ranks}
        return {rank: run for rank, run in runs.items() if run}

    def match_tiers(self, block_hashes: Sequence[int]) -> dict[K, TierMatch]:
        """Each prefill rank's usable run (uncapped), split by tier."""
        matched = self._index.match_tiers(block_hashes)
        return {rank: matched.get(rank) for rank in self._prefill_ranks}

    @property
    def num_in_flight(self) -> int:
        return self._load.num_in_flight

    def check_integrity(self) -> None:
        """Raise unless the index and the loads are consistent with each other and the ranks."""
        self._index.check_integrity()
        self._load.check_integrity()
        stray = set(self._index.ranks) - set(self._prefill_ranks)
        if stray:
            raise IndexIntegrityError(f"index holds blocks of non-prefill ranks {sorted(stray)}")
        branches = sum(v for k, v in self._counters.items() if k.startswith("branch_"))
        routed = self._counters["requests_routed"]
        if branches != routed:
            raise AssertionError(f"{branches} branch decisions for {routed} requests")

    def _tie_break(self, rank: K) -> int:
        salt = self.config.tie_break_salt
        return zlib.crc32(f"{salt}/{rank}".encode()) if salt else 0

    def _decode_candidate(self, rank: K) -> DecodeCandidate[K]:
        stats = self._load.decode_stats(rank)
        in_flight = self._load.decode_requests(rank)
        tie = self._tie_break(rank)
        if stats is None:
            return DecodeCandidate(rank, in_flight, math.inf, tie)
        free = stats.free_pages - self._load.promised_pages(rank)
        return DecodeCandidate(rank, max(in_flight, stats.running), free, tie)
