"""One request's bill, made the same way by every rank that finishes requests (the decode
worker and the colocated worker): the token counts it is given, and its times as differences of
readings of the rank's own monotonic clock, from the request's arrival at the rank."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.wire.messages import Bill, CachedByTier, PrefillAttempt, Speculation


def delivered_prompt_tokens(attempts: Sequence[PrefillAttempt]) -> tuple[int, int]:
    """(cached, new) prompt tokens over the attempts whose KV was delivered: a retry or a
    re-prefill bills its tokens again, a failed attempt none."""
    delivered = [a for a in attempts if a.delivered]
    cached = sum(a.cached_tokens for a in delivered)
    return cached, sum(a.prompt_tokens for a in delivered) - cached


def delivered_cached_by_tier(attempts: Sequence[PrefillAttempt]) -> CachedByTier:
    """The delivered attempts' cached tokens by tier (their total is ``delivered_prompt_tokens``'
    cached)."""
    total = CachedByTier()
    for attempt in attempts:
        if attempt.delivered:
            total = total.plus(attempt.cached_by_tier)
    return total


def build_bill(
    *,
    prompt_tokens: int,
    cached_tokens: int,
    new_prompt_tokens: int,
    output_tokens: int,
    preemptions: int,
    attempts: Sequence[PrefillAttempt],
    arrival: float,
    token_at: Sequence[float],
    now: float,
    pickup_s: float,
    decode_s: float,
    reservation_wait_s: float = 0.0,
    speculation: Speculation | None = None,
    cached_by_tier: CachedByTier | None = None,
) -> Bill:
    """The bill of a request that arrived at ``arrival``, whose output tokens were known at
    ``token_at`` and whose result is made at ``now`` (all on one clock). Without
    ``cached_by_tier`` every cached token is a device hit (a rank with one tier)."""
    times = tuple(t - arrival for t in token_at)
    by_tier = cached_by_tier if cached_by_tier is not None else CachedByTier(device=cached_tokens)
    if by_tier.total != cached_tokens:
        raise ValueError(f"cached tokens by tier {by_tier} do not add up to {cached_tokens}")
    return Bill(
        prompt_tokens=prompt_tokens,
        cached_tokens=cached_tokens,
        cached_tokens_by_tier=by_tier,
        new_prompt_tokens=new_prompt_tokens,
        output_tokens=output_tokens,
        preemptions=preemptions,
        attempts=tuple(attempts),
        pickup_s=pickup_s,
        reservation_wait_s=reservation_wait_s,
        decode_s=decode_s,
        rank_s=now - arrival,
        first_token_s=times[0] if times else 0.0,
        token_times_s=times,
        speculation=speculation or Speculation(),
    )
