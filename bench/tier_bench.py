"""KV tiers off against on, served side by side: ``tandem bench tiers``.

One topology runs in turn on an embedded Ray in this process, as ``tandem bench compare`` runs
presets, in three configurations at the same device capacity (``--device-cache-pages`` per
prefill rank): ``device`` (no lower tier), ``host`` (a host tier of ``--host-cache-pages`` per
prefill rank) and ``host+store`` (and the deployment's own Mooncake store). Each gets a few
warm-up requests, then the same workload as ``tandem bench serve`` over gRPC (a replayed trace
slice is the one that means anything here: it has the conversations whose prefixes come back).
Per configuration it reports the cache-hit share of prompt tokens by tier, TTFT p50/p90 and the
prefill tokens computed (the bills' new prompt tokens), and the ranks' own tier figures (loads,
store writes and errors, recomputes chosen over loads)::

    for config in (device, host, host+store):
        Server(topology + tiers) -> warm-up -> run_plan(plan) -> stop
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import ray

from tandem.bench.compare import add_served_arguments, served
from tandem.bench.serve_bench import Plan, plan_from_args, run_plan
from tandem.bench.serve_report import to_json
from tandem.client.grpc_client import ClientOptions
from tandem.client.output import emit
from tandem.cluster.topology import StoreSpec, Topology, TopologyError
from tandem.wire.messages import RankStats, Role
from tandem.wire.request_params import InvalidRequestError

CONFIGS = ("device", "host", "host+store")


def configure(topology: Topology, config: str, device_pages: int, host_pages: int) -> Topology:
    prefill = topology.prefill.model_copy(
        update={"num_pages": device_pages, "host_cache_pages": host_pages if config != "device" else 0}
    )
    store = StoreSpec() if config == "host+store" else None
    return topology.model_copy(update={"prefill": prefill, "store": store})


def _rank_tiers(stats: list[RankStats]) -> dict[str, Any]:
    prefill = [s.tiers for s in stats if s.role is Role.PREFILL]
    every = [s.tiers for s in stats]
    return {
        "host_load_bytes": sum(t.host_load_bytes for t in prefill),
        "store_load_bytes": sum(t.store_load_bytes for t in prefill),
        "store_writes": sum(t.store_writes for t in every),
        "store_errors": sum(t.store_errors for t in every),
        "store_rejected": sum(t.store_rejected for t in every),
        "recomputed_tokens": sum(t.recomputed_tokens for t in prefill),
    }


def run_tiers(
    topology: Topology,
    plan: Plan,
    device_pages: int,
    host_pages: int,
    model_dir: Path | None,
    dtype: str,
    warmup: int,
) -> dict[str, Any]:
    if device_pages < 1:
        raise InvalidRequestError("--device-cache-pages", f"must be positive, got {device_pages}")
    if host_pages < 1:
        raise InvalidRequestError("--host-cache-pages", f"must be positive, got {host_pages}")
    if topology.colocated is not None:
        raise InvalidRequestError(
            "--preset", f"{topology.name} has a colocated pool; KV tiers serve prefill pools"
        )
    runs: dict[str, Any] = {}
    for config in CONFIGS:
        configured = configure(topology, config, device_pages, host_pages)
        with served(configured, model_dir, dtype, warmup) as server:
            result = asyncio.run(run_plan(ClientOptions(f"127.0.0.1:{server.port}"), plan))
            stats = ray.get(server.controller.stats.remote())
        runs[config] = {"topology": configured.describe(), "ranks_tiers": _rank_tiers(stats), **result}
    return {"device_cache_pages": device_pages, "host_cache_pages": host_pages, "runs": runs}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="local", help="topology preset of deploy/presets")
    parser.add_argument("--device-cache-pages", type=int, default=64, help="device KV pages per prefill rank")
    parser.add_argument("--host-cache-pages", type=int, default=256, help="host KV pages per prefill rank")
    add_served_arguments(parser)


def run_tiers_command(args: argparse.Namespace, fit: Callable[[Topology], Topology] = lambda t: t) -> int:
    """``fit``: the topology for ``--model`` (a DeepSeek-V4's pages, ``tandem serve``'s fitting)."""
    try:
        topology = fit(Topology.preset(args.preset))
    except TopologyError as error:
        raise InvalidRequestError("--preset", str(error)) from None
    plan = plan_from_args(args)
    result = run_tiers(
        topology, plan, args.device_cache_pages, args.host_cache_pages, args.model, args.dtype, args.warmup
    )
    emit(to_json(result) if args.json else format_tiers(result))
    return 0


def format_tiers(result: dict[str, Any]) -> str:
    lines = [
        f"device {result['device_cache_pages']}, host {result['host_cache_pages']} pages a prefill rank",
        f"{'tiers':<11} {'done':>7} {'hit':>6} {'device':>7} {'host':>6} {'store':>6} "
        f"{'TTFT p50':>9} {'TTFT p90':>9} {'computed':>9} {'recomputed':>10} {'store err':>9}",
    ]
    for name, run in result["runs"].items():
        points = run["points"]
        done = sum(p["completed"] for p in points)
        sent = sum(p["requests"] for p in points)
        p = points[-1]
        share = p["cache_hit_share_by_tier"]
        tiers = run["ranks_tiers"]
        ttft = p["ttft_ms"]
        computed = sum(q["new_prompt_tokens"] for q in points)
        lines.append(
            f"{name:<11} {f'{done}/{sent}':>7} {p['cache_hit_share']:>6.1%} {share['device']:>7.1%} "
            f"{share['host']:>6.1%} {share['store']:>6.1%} {ttft['p50']:>7.0f}ms {ttft['p90']:>7.0f}ms "
            f"{computed:>9} {tiers['recomputed_tokens']:>10} {tiers['store_errors']:>9}"
        )
    return "\n".join(lines)
