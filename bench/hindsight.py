"""The bound an autoscaling policy is measured against: a schedule of static pairs chosen in
hindsight, bin by bin of arrivals (``hindsight_schedule``), from what each static pair met in its
own run (``met_by_bin``)."""

from __future__ import annotations

import math
from typing import Any

HINDSIGHT_BIN_S = 60.0


def met_by_bin(outcomes: list[tuple[float, bool]], bin_s: float) -> dict[int, int]:
    met: dict[int, int] = {}
    for arrival, ok in outcomes:
        if ok:
            met[int(arrival // bin_s)] = met.get(int(arrival // bin_s), 0) + 1
    return met


def hindsight_schedule(
    met_by_bin: dict[tuple[int, int], dict[int, int]],
    ranks: dict[tuple[int, int], int],
    at_least: float,
    total: int,
    bin_s: float,
) -> dict[str, Any] | None:
    """What a schedule chosen in hindsight would cost: for each ``bin_s`` of arrivals, one of the
    static pairs, as that pair served those arrivals in its own run, with the SLO met for at least
    ``at_least`` of all requests at the fewest rank-seconds (the pairs' ranks over the bins).

    It knows the future and starts groups in no time, and each bin keeps the cache and the queue
    its static pair had there, so it is a bound to measure a policy against, not one a policy can
    reach. Found by a Lagrangian search: for a price ``lam`` per request met, each bin takes the
    pair with the least ``ranks * bin_s - lam * met``; the smallest price whose schedule meets
    the target is bisected for. ``None`` when no schedule reaches it."""
    if not met_by_bin or total <= 0:
        return None
    bins = range(max((max(m, default=-1) for m in met_by_bin.values()), default=-1) + 1)

    def schedule(lam: float) -> tuple[float, int, list[tuple[int, int]]]:
        chosen = [min(met_by_bin, key=lambda p: (ranks[p] * bin_s - lam * met_by_bin[p].get(b, 0), ranks[p]))
                  for b in bins]  # fmt: skip
        cost = sum(ranks[p] * bin_s for p in chosen)
        return cost, sum(met_by_bin[p].get(b, 0) for b, p in zip(bins, chosen, strict=True)), chosen

    need = math.ceil(at_least * total - 1e-9)
    high = max(ranks.values()) * bin_s + 1.0  # a price above any pair's cost: every bin's most met
    if schedule(high)[1] < need:
        return None
    low = 0.0
    for _ in range(60):
        mid = (low + high) / 2
        if schedule(mid)[1] >= need:
            high = mid
        else:
            low = mid
    cost, met, chosen = schedule(high)
    return {"rank_seconds": round(cost, 1), "slo_attainment": round(met / total, 4),
            "bins": len(chosen), "bin_s": bin_s}  # fmt: skip
