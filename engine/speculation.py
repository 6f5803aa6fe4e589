"""Speculative decoding: its configuration and the one acceptance rule.

A decode step with speculation feeds each running request its last token and up to K draft
tokens, and samples the target model at every one of those positions::

    input      x      e0     e1     e2            x = the last output, e_j = the draft for output o+j
    target     s0     s1     s2     s3            s_j = the target's own sample for output o+j,
                                                      its draw keyed by (seed, o+j) as without drafts
    accepted   s0 .. s_a   where a = the number of leading drafts with e_j == s_j

``s_j`` for ``j <= a`` is the token the request gets without speculation: the positions before
it hold exactly the tokens it would have had, and its draw is the same. So greedy and seeded
requests give the tokens they give with speculation off, in any batch, on any rank, after a
migration too; an unseeded request (the frontend draws it a seed) follows the target's
distribution, since its tokens are the target's own samples. The drafter samples its drafts
with the same draws (common random numbers), so a draft agrees with the target as often as the
two distributions allow. What this rule does not give is the textbook rejection rule's use of a
draft that differs from the sample: a draft is accepted only when it *is* the sample.

Every step accepts at least one token (``s0``), so a request never runs slower in steps than
without drafts; what it pays is the verify forward over ``1 + K`` rows and the drafting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

MAX_SPECULATIVE_TOKENS = 16
DRAFTERS = ("ngram", "mtp")


@dataclass(frozen=True, kw_only=True)
class SpeculativeConfig:
    """``num_tokens``: draft tokens per request per step (K), 0 = off. ``drafter``: ``ngram``
    (prompt lookup: the last ``ngram_max``..``ngram_min`` tokens matched against the request's
    own tokens) or ``mtp`` (the checkpoint's multi-token-prediction layer, run K times chained)."""

    num_tokens: int = 0
    drafter: str = "ngram"
    ngram_min: int = 1
    ngram_max: int = 4

    def __post_init__(self) -> None:
        k = self.num_tokens
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"speculative-tokens: must be an integer in 0..{MAX_SPECULATIVE_TOKENS}, got {k!r}"
            )
        if self.drafter not in DRAFTERS:
            raise ValueError(f"drafter: must be one of {', '.join(DRAFTERS)}, got {self.drafter!r}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(
                "ngram_min, ngram_max: need 1 <= ngram_min <= ngram_max, "
                f"got {self.ngram_min}, {self.ngram_max}"
            )

    @property
    def enabled(self) -> bool:
        return self.num_tokens > 0


def accept(drafts: Sequence[int], target: Sequence[int]) -> tuple[int, ...]:
    """The tokens a verify step gives: the target's samples up to and including the first one
    that differs from its draft (all ``len(drafts) + 1`` when every draft matches)."""
    if len(target) != len(drafts) + 1:
        raise ValueError(f"{len(drafts)} drafts need {len(drafts) + 1} target samples, got {len(target)}")
    n = 0
    while n < len(drafts) and drafts[n] == target[n]:
        n += 1
    return tuple(target[: n + 1])
