"""Round-robin prefill choice: each rank in turn, blind to caches and load (the baseline)."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.router.policy import PolicyConfig, PrefillCandidate, PrefillChoice, PrefillPolicy, PrefillQuery
from tandem.router.rank_key import K


class RoundRobinPolicy(PrefillPolicy[K]):
    name = "round_robin"
    branches = ("round_robin",)

    def __init__(self, config: PolicyConfig) -> None:
        super().__init__(config)
        self._turn = 0

    def choose(self, query: PrefillQuery, candidates: Sequence[PrefillCandidate[K]]) -> PrefillChoice[K]:
        chosen = candidates[self._turn % len(candidates)]
        self._turn += 1
        return PrefillChoice(chosen.rank, "round_robin")
