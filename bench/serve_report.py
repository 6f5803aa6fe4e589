"""``tandem bench serve``'s result as text: a plain table, Markdown tables, or JSON.

Three tables, one row a point: latency and throughput; throughput per rank and per pool; the
mean bill composition (ms). NaN (no completed request) prints as ``-``, and as ``null`` in JSON.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any

Row = list[str]


def _n(value: float | None, digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}"


def _spread(s: dict[str, float]) -> str:
    return "/".join(_n(s[k], 0 if s[k] >= 100 else 1) for k in ("p50", "p90", "p99"))


def _by_tier(shares: dict[str, float]) -> str:
    """Each tier's cache-hit share, device/host/store, in percent."""
    if any(math.isnan(shares[t]) for t in ("device", "host", "store")):
        return "-"
    return "/".join(_n(shares[t] * 100) for t in ("device", "host", "store")) + "%"


def point_name(point: dict[str, Any]) -> str:
    return "trace" if point["concurrency"] is None else f"C={point['concurrency']}"


COMPOSITION_COLUMNS = (
    ("queue", "queue"),
    ("routing", "routing"),
    ("pickup", "pickup"),
    ("reservation_wait", "reserve wait"),
    ("prefill_pickup", "prefill pickup"),
    ("prefill_queue", "prefill queue"),
    ("prefill_compute", "prefill compute"),
    ("kv_transfer_exposed", "transfer exposed"),
    ("kv_wait", "kv wait"),
    ("kv_accept", "kv accept"),
    ("decode", "decode"),
    ("ttft", "ttft"),
    ("e2e", "e2e"),
)


def tables(result: dict[str, Any]) -> list[tuple[str, Row, list[Row]]]:
    """(title, header, rows) of each table."""
    points = result["points"]
    latency_header = [
        "point", "done", "failed", "req/s", "goodput req/s", "in cached tok/s", "in new tok/s", "out tok/s",
        "TTFT ms p50/90/99", "ITL ms p50/90/99", "TPOT ms p50/90/99", "E2E ms p50/90/99", "tok/s/user",
        "cache hit", "hit device/host/store", "predicted/found cached", "accept len",
    ]  # fmt: skip
    latency = [
        [
            point_name(p),
            str(p["completed"]),
            str(p["failed"]),
            _n(p["request_throughput"], 2),
            _n(p["goodput_rps"], 2),
            _n(p["input_tokens_per_s"]["cached"]),
            _n(p["input_tokens_per_s"]["new"]),
            _n(p["output_tokens_per_s"]),
            _spread(p["ttft_ms"]),
            _spread(p["itl_ms"]),
            _spread(p["tpot_ms"]),
            _spread(p["e2e_ms"]),
            _n(p["interactivity_tokens_per_s"]),
            _n(p["cache_hit_share"] * 100) + "%" if not math.isnan(p["cache_hit_share"]) else "-",
            _by_tier(p["cache_hit_share_by_tier"]),
            f"{p['predicted_cached_tokens']}/{p['cached_tokens']}",
            _n(p["speculation"]["acceptance_length"], 2) if p["speculation"]["draft_tokens"] else "-",
        ]
        for p in points
    ]
    per_rank_header = [
        "point", "in tok/s/rank", "out tok/s/rank", "prefill: cached tok/s/rank", "prefill: new tok/s/rank",
        "decode: out tok/s/rank",
    ]  # fmt: skip
    per_rank = [
        [
            point_name(p),
            _n(p["per_rank"]["input_tokens_per_s"]),
            _n(p["per_rank"]["output_tokens_per_s"]),
            _n(p["per_prefill_rank"]["cached"]),
            _n(p["per_prefill_rank"]["new"]),
            _n(p["per_decode_rank"]["output_tokens_per_s"]),
        ]
        for p in points
    ]
    composition_header = ["point", *(title for _, title in COMPOSITION_COLUMNS)]
    composition = [
        [point_name(p), *(_n(p["composition_ms"][key]) for key, _ in COMPOSITION_COLUMNS)] for p in points
    ]
    out = [
        ("latency and throughput (client clock)", latency_header, latency),
        ("throughput per rank and per pool", per_rank_header, per_rank),
        ("mean composition from the bills, ms", composition_header, composition),
    ]
    if "gpu_hour_price" in result:
        price_header = ["point", "cached input $/Mtok", "new input $/Mtok", "output $/Mtok", "blended $/Mtok"]
        kinds = ("cached_input", "new_input", "output", "blended")
        prices = [[point_name(p), *(_n(p["price_per_mtok"][k], 3) for k in kinds)] for p in points]
        out.append((f"price at ${result['gpu_hour_price']:g} per GPU-hour", price_header, prices))
    return out


def _preamble(result: dict[str, Any]) -> list[str]:
    d, w = result["deployment"], result["workload"]
    shape = f"{d['prefill_ranks']} prefill + {d['decode_ranks']} decode ranks"
    if d.get("colocated_ranks"):
        shape = f"{d['colocated_ranks']} colocated ranks"
    lines = [f"{d['addr']}: model {d['model']}, {shape}"]
    if w["kind"] == "trace":
        lines.append(f"trace replay: {w['requests']} requests, {w['clipped']} clipped to the context")
    else:
        lines.append(
            f"synthetic: {w['prompt_tokens']} prompt tokens ({w['shared_prefix_tokens']} shared, "
            f"{w['prefixes']} prefixes), {w['output_tokens']} output tokens"
        )
    slo = result["points"][0]["slo"] if result["points"] else None
    if slo is not None:
        lines.append(f"goodput SLO: TTFT <= {slo['ttft_ms']:g} ms and mean ITL <= {slo['itl_ms']:g} ms")
    for p in result["points"]:
        if p["failed"]:
            lines.append(f"{point_name(p)}: {p['failed']} failed: {'; '.join(p['errors'])}")
    return lines


def _render(
    result: dict[str, Any], table: Callable[[Row, list[Row]], list[str]], title: Callable[[str], str]
) -> str:
    lines = _preamble(result)
    for name, header, rows in tables(result):
        lines += ["", title(name), *table(header, rows)]
    return "\n".join(lines)


def _plain(header: Row, rows: list[Row]) -> list[str]:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)]


def _markdown(header: Row, rows: list[Row]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "|".join("---" for _ in header) + "|",
        *("| " + " | ".join(r) + " |" for r in rows),
    ]


def format_table(result: dict[str, Any]) -> str:
    return _render(result, _plain, lambda name: name + ":")


def format_markdown(result: dict[str, Any]) -> str:
    return _render(result, _markdown, lambda name: f"**{name}**\n")


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def to_json(result: dict[str, Any]) -> str:
    """One line of strict JSON (NaN as null)."""
    return json.dumps(_finite(result), allow_nan=False)
