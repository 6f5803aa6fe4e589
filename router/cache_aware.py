"""Cache-aware prefill choice, in three branches::

    low_match  the longest usable run (device, host and store blocks) covers < cache_threshold
               of the reusable blocks (a new conversation) -> least-loaded rank
    cache_hit  otherwise -> highest score among ranks that are not overloaded
    balance    as cache_hit, but the rank whose tiers save the most was overloaded and skipped

The score is the rank's expected time to first token, in tokens and negated (higher is
sooner)::

    score = page_size x (device + host x (1 - host_cost)+ + store x (1 - store_cost)+)
            - load_weight x in-flight tokens

Each tier's blocks save their tokens' compute less the time to load them, as a fraction of it
(the rank's own prices, ``PrefillCandidate.host_load_cost``); a tier priced at 1 or more saves
nothing, because the rank computes those tokens again rather than wait for them. A device block
saves its whole compute. Since every rank reads the store, a store run alone gives every rank
the same saving, and load decides.

A rank is overloaded when its in-flight tokens exceed the least-loaded rank's by more than
``balance_abs_threshold_tokens`` and by more than ``balance_rel_threshold`` times. Unlike a
global imbalance switch (send everything to the least-loaded rank while any rank lags), only
conversations held by a lagging rank move, so one long prompt does not scatter every other
conversation away from its cache. Moving a conversation costs its prefix once (less what the
store still holds); the copy then serves its later turns.
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
        longest = max(c.matched_blocks for c in candidates)
        if longest == 0 or longest < config.cache_threshold * query.max_reusable_blocks:
            return PrefillChoice(least_loaded(candidates).rank, "low_match")
        saved = {c.rank: c.saved_blocks() * query.page_size for c in candidates}
        best_saving = max(candidates, key=lambda c: (saved[c.rank], -c.in_flight_tokens))
        skipped = overloaded(candidates, config)
        eligible = [c for c in candidates if c.rank not in skipped]  # never empty: the least loaded stays
        weight = config.load_weight

        def score(c: PrefillCandidate[K]) -> tuple[float, int, int, int]:
            return (
                saved[c.rank] - weight * c.in_flight_tokens,
                -c.in_flight_tokens,
                -c.routed_tokens,
                -c.tie_break,
            )

        chosen = max(eligible, key=score)
        return PrefillChoice(chosen.rank, "balance" if best_saving.rank in skipped else "cache_hit")
