"""``tandem bench autoscale``'s table: per trace, the autoscaler beside the static pairs and the
hindsight schedule, each as SLO attainment over rank-seconds."""

from __future__ import annotations

from typing import Any

from tandem.autoscaler.config import AutoscalingConfig


def format_report(results: list[dict[str, Any]], config: AutoscalingConfig) -> str:
    """One row per trace: the autoscaler next to the cheapest static pair at or above its
    attainment, the best static pair within its rank-seconds, and the cheapest at 0.99."""

    def pair(s: dict[str, Any] | None) -> str:
        if s is None:
            return "none"
        sizes = f"{s['prefill_groups']}P+{s['decode_groups']}D"
        return f"{sizes} {s['slo_attainment']:.3f} / {s['rank_seconds']:,.0f}"

    def hindsight(r: dict[str, Any]) -> str:
        h, at = r.get("hindsight_at_autoscaler_attainment"), r["cheapest_static_at_autoscaler_attainment"]
        if h is None:
            return "none"
        ratio = f" ({h['rank_seconds'] / at['rank_seconds']:.2f})" if at else ""
        return f"{h['slo_attainment']:.3f} / {h['rank_seconds']:,.0f}{ratio}"

    lines = [
        f"SLO: TTFT <= {config.ttft_slo_s:g} s and mean ITL <= {config.itl_slo_s:g} s; budget "
        f"{config.rank_budget} ranks; attainment / rank-seconds",
        "| trace | autoscaler | cheapest static at >= its attainment (ratio) | best static within its "
        "rank-seconds | cheapest static at >= 0.99 (ratio) | hindsight schedule at its attainment "
        "(ratio) |",
        "|---|---|---|---|---|---|",
    ]
    for r in results:
        a = r["autoscaler"]
        c99 = r["cheapest_static_at_0.99"]
        ratio99 = f" ({a['rank_seconds'] / c99['rank_seconds']:.2f})" if c99 else ""
        ratio = r["rank_seconds_ratio"]
        lines.append(
            f"| {r['trace']} | {a['slo_attainment']:.3f} / {a['rank_seconds']:,.0f} ({a['adds']} adds, "
            f"{a['drains']} drains) | {pair(r['cheapest_static_at_autoscaler_attainment'])}"
            f"{f' ({ratio:.2f})' if ratio is not None else ''} | "
            f"{pair(r['best_static_at_autoscaler_rank_seconds'])} | {pair(c99)}{ratio99} | "
            f"{hindsight(r)} |"
        )
    return "\n".join(lines)
