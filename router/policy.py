"""The prefill policy interface: given what each prefill rank holds and has queued, pick one.

A policy sees plain numbers, never the index or the tracker, so each is a small pure function
of its inputs (plus whatever state it keeps itself, like a round-robin cursor). Policies are
registered by name in ``router.registry``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Generic

from tandem.router.rank_key import K


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds of the cache-aware policy. Loads are in-flight new (uncached) prefill tokens.

    Defaults tuned with ``tandem bench router`` on the Mooncake conversation trace (8 prefill
    ranks of 6,000 tokens/s): moving a conversation costs its whole history once, so the
    policy keeps conversations where their prefix is unless a rank is far behind.
    """

    # A rank is overloaded, and loses its conversations to others, when its in-flight tokens
    # exceed the least-loaded rank's by more than this (150k tokens: 25 s of prefill at
    # 6,000 tokens/s) and by more than balance_rel_threshold times.
    balance_abs_threshold_tokens: int = 150_000
    balance_rel_threshold: float = 2.0
    # A prompt whose longest match covers less than this share of its reusable blocks is a new
    # conversation and goes to the least-loaded rank.
    cache_threshold: float = 0.1
    # Score of a rank for a matched prompt: tokens its cache saves minus this times its
    # in-flight tokens. Small, because a moved conversation also loses its later turns' hits.
    load_weight: float = 0.05

    def __post_init__(self) -> None:
        if self.balance_abs_threshold_tokens < 0:
            raise ValueError(f"balance_abs_threshold_tokens < 0: {self.balance_abs_threshold_tokens}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.load_weight < 0.0:
            raise ValueError(f"load_weight must be >= 0, got {self.load_weight}")


@dataclass(frozen=True)
class PrefillQuery:
    """The request being routed: prompt length and how many full blocks the rank may reuse."""

    num_prompt_tokens: int
    num_blocks: int  # hashed full blocks of the prompt
    max_reusable_blocks: int  # (num_prompt_tokens - 1) // page_size: one token is always computed
    page_size: int


@dataclass(frozen=True)
class PrefillCandidate(Generic[K]):
    """One prefill rank as the policy sees it."""

    rank: K
    matched_blocks: int  # leading blocks it holds, already capped at max_reusable_blocks
    in_flight_tokens: int  # new tokens pending on it: this router's, or the rank's report if larger
    routed_tokens: int  # new tokens routed to it since it joined, done or not
    cached_blocks: int  # size of its prefix cache
    tie_break: int = 0  # the router's own order of ranks, for ties (see ``RouterConfig.tie_break_salt``)


@dataclass(frozen=True)
class PrefillChoice(Generic[K]):
    rank: K
    branch: str  # one of the policy's ``branches``, counted by the router


class PrefillPolicy(ABC, Generic[K]):
    """Picks a prefill rank. ``candidates`` is never empty and is sorted by rank key (see
    ``router.rank_key``: for names, their string order)."""

    name: ClassVar[str]
    branches: ClassVar[tuple[str, ...]]  # every branch ``choose`` may report

    def __init__(self, config: PolicyConfig) -> None:
        self.config = config

    @abstractmethod
    def choose(self, query: PrefillQuery, candidates: Sequence[PrefillCandidate[K]]) -> PrefillChoice[K]: ...


def least_loaded(candidates: Sequence[PrefillCandidate[K]]) -> PrefillCandidate[K]:
    """Fewest in-flight tokens. Ties, common when ranks are idle, go to the rank that was given
    the fewest tokens so far: a name order would hand the first rank every new conversation of
    a quiet period, and conversations stay where they start. Then each router's own order, so
    that several frontends with equal counts do not all pick the same rank at once."""
    return min(candidates, key=lambda c: (c.in_flight_tokens, c.routed_tokens, c.tie_break, c.rank))
