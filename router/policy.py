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

# The tier prices' defaults, for DeepSeek-V3 on H200 prefill ranks. A token's KV is the MLA
# latent cache: 61 layers x (512 + 64) x 2 bytes = 70,272 bytes. A rank prefills ~6,000 uncached
# tokens/s (router_bench's DEFAULT_PREFILL_TOKENS_PER_S), so computing a token takes ~167 us.
KV_BYTES_PER_TOKEN = 70_272
PREFILL_TOKENS_PER_S = 6_000.0
HOST_LOAD_BYTES_PER_S = 25e9  # pinned host memory to HBM over PCIe Gen5 x16 or NVLink-C2C
STORE_LOAD_BYTES_PER_S = 5e9  # a shared store over RDMA: 5-10 GB/s a rank, the slow end


def load_cost(load_bytes_per_s: float, prefill_tokens_per_s: float, kv_bytes_per_token: int) -> float:
    """The time to load one cached token at ``load_bytes_per_s``, as a fraction of the time to
    compute it at ``prefill_tokens_per_s``: (bytes/token / bytes/s) / (1 / tokens/s)."""
    if not (load_bytes_per_s > 0 and prefill_tokens_per_s > 0 and kv_bytes_per_token > 0):
        speeds = f"{load_bytes_per_s=} {prefill_tokens_per_s=} {kv_bytes_per_token=}"
        raise ValueError(f"load_cost needs positive speeds: {speeds}")
    return kv_bytes_per_token * prefill_tokens_per_s / load_bytes_per_s


# 70,272 B / 25 GB/s = 2.8 us a token against 167 us to compute it: 70,272 x 6,000 / 25e9 = 0.0169.
DEFAULT_HOST_LOAD_COST = load_cost(HOST_LOAD_BYTES_PER_S, PREFILL_TOKENS_PER_S, KV_BYTES_PER_TOKEN)
# 70,272 B / 5 GB/s = 14.1 us a token: 70,272 x 6,000 / 5e9 = 0.0843 (0.042 at 10 GB/s).
DEFAULT_STORE_LOAD_COST = load_cost(STORE_LOAD_BYTES_PER_S, PREFILL_TOKENS_PER_S, KV_BYTES_PER_TOKEN)


@dataclass(frozen=True)
class PolicyConfig:
    """Thresholds of the cache-aware policy. Loads are in-flight new (uncached) prefill tokens.

    Defaults tuned with ``tandem bench router`` on the Mooncake conversation trace (8 prefill
    ranks of 6,000 tokens/s): moving a conversation costs its whole history once, so the
    policy keeps conversations where their prefix is unless a rank is far behind.

    Tier prices, loading a token against computing it, for DeepSeek-V3 (MLA KV: 61 layers x
    576 x 2 bytes = 70,272 bytes a token) on a rank prefilling 6,000 tokens/s (167 us a token):

        host   25 GB/s (pinned, PCIe Gen5 / NVLink-C2C)   2.8 us a token   70,272 x 6,000 / 25e9 = 0.017
        store   5 GB/s (RDMA, the slow end of 5-10)      14.1 us a token   70,272 x 6,000 /  5e9 = 0.084

    A rank's measured prices (``Router.set_tier_costs``) replace these for that rank.
    """

    # A rank is overloaded, and loses its conversations to others, when its in-flight tokens
    # exceed the least-loaded rank's by more than this (150k tokens: 25 s of prefill at
    # 6,000 tokens/s) and by more than balance_rel_threshold times.
    balance_abs_threshold_tokens: int = 150_000
    balance_rel_threshold: float = 2.0
    # A prompt whose longest match covers less than this share of its reusable blocks is a new
    # conversation and goes to the least-loaded rank.
    cache_threshold: float = 0.1
    # Score of a rank for a matched prompt: tokens its tiers save minus this times its
    # in-flight tokens. Small, because a moved conversation also loses its later turns' hits.
    load_weight: float = 0.05
    # The time to load one cached token from the rank's host tier, and from the shared store, as
    # a fraction of the time to compute it (see DEFAULT_HOST_LOAD_COST and DEFAULT_STORE_LOAD_COST
    # above for the arithmetic): a block loaded from there saves (1 - cost) of its tokens, and
    # nothing at cost >= 1. The defaults for ranks whose own measured prices are not known
    # (``Router.set_tier_costs``).
    host_load_cost: float = DEFAULT_HOST_LOAD_COST
    store_load_cost: float = DEFAULT_STORE_LOAD_COST

    def __post_init__(self) -> None:
        if self.balance_abs_threshold_tokens < 0:
            raise ValueError(f"balance_abs_threshold_tokens < 0: {self.balance_abs_threshold_tokens}")
        if self.balance_rel_threshold < 1.0:
            raise ValueError(f"balance_rel_threshold must be >= 1, got {self.balance_rel_threshold}")
        if not 0.0 <= self.cache_threshold <= 1.0:
            raise ValueError(f"cache_threshold must be in [0, 1], got {self.cache_threshold}")
        if self.load_weight < 0.0:
            raise ValueError(f"load_weight must be >= 0, got {self.load_weight}")
        for name in ("host_load_cost", "store_load_cost"):
            if not getattr(self, name) >= 0.0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")


@dataclass(frozen=True)
class PrefillQuery:
    """The request being routed: prompt length and how many full blocks the rank may reuse."""

    num_prompt_tokens: int
    num_blocks: int  # hashed full blocks of the prompt
    max_reusable_blocks: int  # (num_prompt_tokens - 1) // page_size: one token is always computed
    page_size: int


@dataclass(frozen=True)
class PrefillCandidate(Generic[K]):
    """One prefill rank as the policy sees it. ``matched_blocks`` is its whole usable run (its
    device, its host tier and the store: ``router.index``); ``host_blocks`` and ``store_blocks``
    are the parts of it loaded from those tiers, the rest is on its device. The load costs are
    the rank's own prices (``PolicyConfig.host_load_cost``)."""

    rank: K
    matched_blocks: int  # usable run, already capped at max_reusable_blocks
    in_flight_tokens: int  # new tokens pending on it: this router's, or the rank's report if larger
    routed_tokens: int  # new tokens routed to it since it joined, done or not
    cached_blocks: int  # blocks on its device
    tie_break: int = 0  # the router's own order of ranks, for ties (see ``RouterConfig.tie_break_salt``)
    host_blocks: int = 0
    store_blocks: int = 0
    host_load_cost: float = DEFAULT_HOST_LOAD_COST
    store_load_cost: float = DEFAULT_STORE_LOAD_COST

    def __post_init__(self) -> None:
        if min(self.host_blocks, self.store_blocks) < 0 or self.host_blocks + self.store_blocks > (
            self.matched_blocks
        ):
            raise ValueError(
                f"{self.rank}: {self.host_blocks} host and {self.store_blocks} store blocks "
                f"in a run of {self.matched_blocks}"
            )

    @property
    def device_blocks(self) -> int:
        return self.matched_blocks - self.host_blocks - self.store_blocks

    def saved_blocks(self) -> float:
        """Blocks of compute the run saves: a device block 1, a loaded one 1 - its tier's cost
        (nothing when loading is slower than computing: the rank computes it again)."""
        return (
            self.device_blocks
            + self.host_blocks * max(0.0, 1.0 - self.host_load_cost)
            + self.store_blocks * max(0.0, 1.0 - self.store_load_cost)
        )


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
