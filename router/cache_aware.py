"""Cache-aware prefill choice, in three branches::

    low_match  the best match covers < cache_threshold of the reusable blocks (a new
               conversation) -> least-loaded rank
    cache_hit  otherwise -> highest score among ranks that are not overloaded:
               tokens the rank's cache saves - load_weight x its in-flight tokens
    balance    as cache_hit, but the rank with the longest match was overloaded and skipped

A rank is overloaded when its in-flight tokens exceed the least-loaded rank's by more than
``balance_abs_threshold_tokens`` and by more than ``balance_rel_threshold`` times. Unlike a
global imbalance switch (send everything to the least-loaded rank while any rank lags), only
conversations held by a lagging rank move, so one long prompt does not scatter every other
conversation away from its cache. Moving a conversation costs its prefix once; the copy then
serves its later turns.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.router.policy import (
    PolicyConfig,
    PrefillCandidate,
    PrefillChoice,
    PrefillPolicy,
    PrefillQuery,
    least_loaded,
)
from tandem.router.rank_key import K


def overloaded(candidates: Sequence[PrefillCandidate[K]], config: PolicyConfig) -> set[K]:
    """Ranks lagging far enough behind the least-loaded one to be skipped."""
    low = min(c.in_flight_tokens for c in candidates)
    return {
        c.rank
        for c in candidates
        if c.in_flight_tokens - low > config.balance_abs_threshold_tokens
        and c.in_flight_tokens > config.balance_rel_threshold * low
    }


class CacheAwarePolicy(PrefillPolicy[K]):
    name = "cache_aware"
    branches = ("balance", "cache_hit", "low_match")

    def choose(self, query: PrefillQuery, candidates: Sequence[PrefillCandidate[K]]) -> PrefillChoice[K]:
        config = self.config
        best_match = max(candidates, key=lambda c: (c.matched_blocks, -c.in_flight_tokens))
        if best_match.matched_blocks == 0 or best_match.matched_blocks < (
            config.cache_threshold * query.max_reusable_blocks
        ):
            return PrefillChoice(least_loaded(candidates).rank, "low_match")
        skipped = overloaded(candidates, config)
        eligible = [c for c in candidates if c.rank not in skipped]  # never empty: the least loaded stays
        page_size, weight = query.page_size, config.load_weight

        def score(c: PrefillCandidate[K]) -> tuple[float, int, int, int]:
            saved = c.matched_blocks * page_size - weight * c.in_flight_tokens
            return saved, -c.in_flight_tokens, -c.routed_tokens, -c.tie_break

        chosen = max(eligible, key=score)
        return PrefillChoice(chosen.rank, "balance" if best_match.rank in skipped else "cache_hit")
