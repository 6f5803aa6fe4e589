"""The autoscaler's signals read from Prometheus' HTTP API with PromQL over Tandem's metrics.

Every query is configurable; ``$window`` (a PromQL duration), ``$burst`` (``BURST_WINDOW_S``)
and ``$model`` are filled in.
An empty answer or NaN (no sample in the window) is ``None``: no traffic, not zero latency.
The prefill pool's busy groups, mean new prompt tokens per request, backlog (requests waiting
times that mean, in tokens), arrival rate (of the new prompt tokens the router routed) and its
peak (the largest ``$burst`` rate within the window, evaluated every second), and the decode pool's
backlog (requests waiting for pages or a batch slot) are the planner's."""

from __future__ import annotations

import json
import math
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from string import Template

from tandem.autoscaler.signals import BURST_WINDOW_S, MetricSource, PoolSignals
from tandem.wire.messages import Role


def _p90(histogram: str) -> str:
    return f'histogram_quantile(0.9, sum by (le) (rate({histogram}_bucket{{model="$model"}}[$window])))'


def _mean_part(histogram: str, part: str) -> str:
    selector = f'{{model="$model",part="{part}"}}[$window]'
    return f"sum(rate({histogram}_sum{selector})) / sum(rate({histogram}_count{selector}))"


def _groups(role: str, states: str) -> str:
    return f'sum(tandem_group_state{{model="$model",role="{role}",state=~"{states}"}})'


DEFAULT_QUERIES: dict[str, str] = {
    "prefill_latency_p90_s": _p90("tandem_time_to_first_token_seconds"),
    "decode_latency_p90_s": _p90("tandem_inter_token_latency_seconds"),
    "prefill_queue_s": _mean_part("tandem_request_prefill_part_seconds", "prefill_queue"),
    "decode_queue_s": _mean_part("tandem_request_latency_part_seconds", "reservation_wait"),
    "decode_kv_usage": 'max(tandem_kv_cache_usage_ratio{model="$model",role="decode"})',
    "prefill_demand": 'sum(rate(tandem_new_prompt_tokens_total{model="$model"}[$window]))',
    "decode_demand": 'sum(tandem_num_requests_running{model="$model",role="decode"})'
    ' + sum(tandem_num_requests_waiting_for_kv{model="$model",role="decode"})',
    # a group's ranks step together, and only while one of them has work: its busy share is
    # any rank's time in steps a second
    "prefill_busy_groups": 'sum(max by (group) (rate(tandem_step_seconds_total{model="$model",role="prefill"}'
    "[$window])))",
    "prefill_prompt_tokens": 'sum(rate(tandem_new_prompt_tokens_total{model="$model"}[$window]))'
    ' / sum(rate(tandem_request_prefill_part_seconds_count{model="$model",part="prefill_queue"}[$window]))',
    "prefill_arrival_rate": 'sum(rate(tandem_router_new_prompt_tokens_total{model="$model"}[$window]))',
    "prefill_demand_peak": 'max_over_time(sum(rate(tandem_router_new_prompt_tokens_total{model="$model"}'
    "[$burst]))[$window:1s])",
    "prefill_waiting": 'sum(tandem_num_requests_waiting{model="$model",role="prefill"})',
    "decode_waiting": 'sum(tandem_num_requests_waiting{model="$model",role="decode"})',
    "prefill_ready_groups": _groups("prefill", "ready"),
    "decode_ready_groups": _groups("decode", "ready"),
    "prefill_pending_groups": _groups("prefill", "starting|draining"),
    "decode_pending_groups": _groups("decode", "starting|draining"),
}


class PrometheusQueryError(RuntimeError):
    def __init__(self, url: str, query: str, reason: str) -> None:
        super().__init__(f"Prometheus at {url} could not answer {query!r}: {reason}")


@dataclass
class PrometheusSource(MetricSource):
    """``url`` is Prometheus' base URL (``http://HOST:9090``); ``window`` the PromQL range of the
    rates and quantiles."""

    url: str
    model: str
    window: str = "1m"
    queries: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_QUERIES))
    timeout_s: float = 5.0

    def query(self, name: str) -> float | None:
        promql = Template(self.queries[name]).substitute(
            model=self.model, window=self.window, burst=f"{BURST_WINDOW_S:g}s"
        )
        address = f"{self.url.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': promql})}"
        try:
            with urllib.request.urlopen(address, timeout=self.timeout_s) as reply:
                body = json.load(reply)
        except (OSError, ValueError) as exc:
            raise PrometheusQueryError(self.url, promql, str(exc)) from exc
        if body.get("status") != "success":
            raise PrometheusQueryError(self.url, promql, str(body.get("error", body)))
        result = body["data"]["result"]
        if not result:
            return None
        value = float(result[0]["value"][1])
        return None if math.isnan(value) else value

    def read(self) -> dict[Role, PoolSignals]:
        out = {}
        for pool in (Role.PREFILL, Role.DECODE):
            name = pool.value
            planner: dict[str, float | None] = {}
            if pool is Role.DECODE:  # what the planner reads besides
                planner = {"backlog": self.query("decode_waiting")}
            if pool is Role.PREFILL:
                prompt = self.query("prefill_prompt_tokens")
                waiting = self.query("prefill_waiting")
                planner = {
                    "busy_groups": self.query("prefill_busy_groups"),
                    "prompt_tokens": prompt,
                    "backlog": waiting * prompt if waiting is not None and prompt is not None else None,
                    "arrival_rate": self.query("prefill_arrival_rate"),
                    "demand_peak": self.query("prefill_demand_peak"),
                }
            out[pool] = PoolSignals(
                ready_groups=int(self.query(f"{name}_ready_groups") or 0),
                pending_groups=int(self.query(f"{name}_pending_groups") or 0),
                latency_p90_s=self.query(f"{name}_latency_p90_s"),
                queue_s=self.query(f"{name}_queue_s"),
                kv_usage=self.query("decode_kv_usage") if pool is Role.DECODE else None,
                demand=self.query(f"{name}_demand"),
                **planner,
            )
        return out
