"""A point's throughput as a price per million tokens, at a GPU-hour price (``tandem bench serve
--gpu-hour-price P``). Each pool's GPU time over the point (its ranks x the point's wall time) is
charged to the tokens it serves: the decode pool's to the output tokens, the prefill pool's to
the prompt tokens, a cached one counted ``cached_weight`` of a new one (it is looked up and
moved, not computed; the default 0.1 is the share DeepSeek's API charges for a cache hit). A
colocated deployment's ranks do both, so only its blended price (every token alike) is given.
The price is the deployment's at the measured load: ranks idle at a light point still cost."""

from __future__ import annotations

import math
from typing import Any

DEFAULT_CACHED_WEIGHT = 0.1


def point_prices(
    point: dict[str, Any], deployment: dict[str, Any], gpu_hour_price: float, cached_weight: float
) -> dict[str, float]:
    """$ per million tokens of each kind (``nan`` where the point has none of that kind)."""
    hours = point["wall_s"] / 3600.0
    new, cached, output = point["new_prompt_tokens"], point["cached_tokens"], point["output_tokens"]
    colocated = deployment.get("colocated_ranks") or 0
    prefill, decode = deployment.get("prefill_ranks", 0), deployment.get("decode_ranks", 0)
    total_cost = (colocated + prefill + decode) * gpu_hour_price * hours
    prices = {"blended": _per_million(total_cost, new + cached + output)}
    if colocated:
        return {"cached_input": math.nan, "new_input": math.nan, "output": math.nan, **prices}
    prefill_cost, decode_cost = prefill * gpu_hour_price * hours, decode * gpu_hour_price * hours
    new_input = _per_million(prefill_cost, new + cached_weight * cached)
    return {
        "cached_input": cached_weight * new_input if cached else math.nan,
        "new_input": new_input if new else math.nan,
        "output": _per_million(decode_cost, output),
        **prices,
    }


def _per_million(cost: float, tokens: float) -> float:
    return cost / tokens * 1e6 if tokens > 0 else math.nan
