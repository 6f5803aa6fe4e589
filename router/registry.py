"""Prefill policies by name."""

from __future__ import annotations

from typing import Any

from tandem.router.cache_aware import CacheAwarePolicy
from tandem.router.least_loaded import LeastLoadedPolicy
from tandem.router.policy import PolicyConfig, PrefillPolicy
from tandem.router.rank_key import K
from tandem.router.round_robin import RoundRobinPolicy

DEFAULT_POLICY = CacheAwarePolicy.name
# Each policy works for any rank key (``router.rank_key``); the caller's context picks it.
PREFILL_POLICIES: dict[str, type[PrefillPolicy[Any]]] = {
    policy.name: policy for policy in (CacheAwarePolicy, RoundRobinPolicy, LeastLoadedPolicy)
}


class UnknownPolicy(ValueError):
    def __init__(self, name: str) -> None:
        super().__init__(f"unknown prefill policy {name!r}; choose one of {sorted(PREFILL_POLICIES)}")
        self.name = name


def make_prefill_policy(name: str = DEFAULT_POLICY, config: PolicyConfig | None = None) -> PrefillPolicy[K]:
    policy = PREFILL_POLICIES.get(name)
    if policy is None:
        raise UnknownPolicy(name)
    return policy(config or PolicyConfig())
