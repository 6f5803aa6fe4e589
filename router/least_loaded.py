"""Least-loaded prefill choice: fewest in-flight new tokens, blind to what the ranks cache."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.router.policy import PrefillCandidate, PrefillChoice, PrefillPolicy, PrefillQuery, least_loaded
from tandem.router.rank_key import K


class LeastLoadedPolicy(PrefillPolicy[K]):
    name = "least_loaded"
    branches = ("least_loaded",)

    def choose(self, query: PrefillQuery, candidates: Sequence[PrefillCandidate[K]]) -> PrefillChoice[K]:
        return PrefillChoice(least_loaded(candidates).rank, "least_loaded")
