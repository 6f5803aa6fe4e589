"""Disaggregated against colocated serving on the same cores: goodput at one SLO, side by side.

Each preset runs in turn on an embedded Ray in this process: the same model, every rank's
process pinned to its run of the machine's cores (``pin_cores_per_rank``, ranks in deployment
order, wrapping), a few warm-up requests through the frontend, then the same workload as
``tandem bench serve`` (a replayed trace slice, or closed-loop points) over gRPC from here. A
preset's goodput is its requests that met both SLOs per second of the run; ``ratio`` is the
disaggregated preset's over the colocated one's, whichever way it comes out.

::

    for preset in presets:      Topology.preset(preset) + pin_cores_per_rank
        Server.start()  ->  warm-up  ->  run_plan(plan) over gRPC  ->  Server.stop()
    goodput_rps[preset]; ratio = disaggregated / colocated
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tandem.bench.serve_bench import Plan, add_workload_arguments, plan_from_args, run_plan
from tandem.bench.serve_report import to_json
from tandem.client.grpc_client import ClientOptions
from tandem.client.output import emit
from tandem.cluster.ray_bootstrap import init_ray, shutdown_ray
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import Topology, TopologyError
from tandem.wire.request_params import InvalidRequestError, SamplingParams

WARMUP_PROMPT_TOKENS = 64


def check_presets(names: list[str]) -> dict[str, Topology]:
    """The presets to compare, each loaded; an error names ``--presets``."""
    if len(names) < 2 or len(set(names)) != len(names):
        raise InvalidRequestError(
            "--presets", f"expected two or more distinct presets, got {','.join(names)!r}"
        )
    try:
        topologies = {name: Topology.preset(name) for name in names}
    except TopologyError as exc:
        raise InvalidRequestError("--presets", exc.message) from None
    check_kinds(topologies)
    return topologies


def check_kinds(topologies: dict[str, Topology]) -> str:
    """The colocated one's name; there must be exactly one, and at least one other."""
    colocated = [name for name, t in topologies.items() if t.colocated is not None]
    if len(colocated) != 1 or len(topologies) < 2:
        raise InvalidRequestError(
            "--presets",
            "expected one colocated preset and one or more disaggregated ones (e.g. colocated,local)",
        )
    return colocated[0]


def _warm_up(server: Server, requests: int) -> None:
    """Compile paths and fill allocator caches before measuring (the first forwards are slow)."""
    if requests < 1:
        return
    prompts = [[(i * 7 + j) % 256 for j in range(WARMUP_PROMPT_TOKENS)] for i in range(requests)]
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    for summary in server.generate(prompts, [sampling] * requests):
        if summary.error:
            raise RuntimeError(f"warm-up request failed: {summary.error}")


@contextlib.contextmanager
def served(topology: Topology, model_dir: Path | None, dtype: str, warmup: int) -> Iterator[Server]:
    """``topology`` deployed on an embedded Ray in this process and warmed up; stopped after."""
    init_ray()
    try:
        server = Server(ServeOptions(topology, model_dir, port=0, dtype=dtype))
        server.start()
        try:
            _warm_up(server, warmup)
            yield server
        finally:
            server.stop()
    finally:
        shutdown_ray()


def run_one(
    topology: Topology, cores_per_rank: int, plan: Plan, model_dir: Path | None, dtype: str, warmup: int
) -> dict[str, Any]:
    """One preset's run: its deployment started, warmed up, driven by ``plan``, stopped."""
    pinned = topology.model_copy(update={"pin_cores_per_rank": cores_per_rank})
    with served(pinned, model_dir, dtype, warmup) as server:
        result = asyncio.run(run_plan(ClientOptions(f"127.0.0.1:{server.port}"), plan))
    return {"topology": pinned.describe(), "ranks": pinned.ranks, **result}


def run_compare(
    topologies: dict[str, Topology],
    cores_per_rank: int,
    plan: Plan,
    model_dir: Path | None = None,
    dtype: str = "float32",
    warmup: int = 4,
) -> dict[str, Any]:
    """Every deployment in turn on the same cores; the ``--json`` object."""
    if cores_per_rank < 1:
        raise InvalidRequestError("--cores-per-rank", f"must be at least 1, got {cores_per_rank}")
    colocated = check_kinds(topologies)
    runs = {
        name: run_one(t, cores_per_rank, plan, model_dir, dtype, warmup) for name, t in topologies.items()
    }
    goodput = {name: _goodput(run) for name, run in runs.items()}
    ratios = {name: _ratio(g, goodput[colocated]) for name, g in goodput.items() if name != colocated}
    return {
        "machine_cores": os.cpu_count(),
        "cores_per_rank": cores_per_rank,
        "slo": {"ttft_ms": plan.slo_ttft_ms, "itl_ms": plan.slo_itl_ms},
        "goodput_rps": goodput,
        "colocated": colocated,
        "ratio": next(iter(ratios.values())) if len(ratios) == 1 else ratios,
        "ratios": ratios,
        "runs": runs,
    }


def _goodput(run: dict[str, Any]) -> float:
    """Requests that met both SLOs per second, over every point of the run."""
    points = run["points"]
    met = sum(p["goodput_rps"] * p["wall_s"] for p in points)
    return met / sum(p["wall_s"] for p in points)


def _ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tandem bench compare``: the presets, the cores, and bench serve's workload."""
    parser.add_argument(
        "--presets", default="colocated,local", help="comma-separated: one colocated, the rest not"
    )
    parser.add_argument(
        "--cores-per-rank", type=int, default=1, help="cores each rank's process is pinned to"
    )
    add_served_arguments(parser)


def add_served_arguments(parser: argparse.ArgumentParser) -> None:
    """What every served side-by-side bench takes: the model, its dtype, the warm-up, bench
    serve's workload and ``--json``."""
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    parser.add_argument(
        "--warmup", type=int, default=4, help="requests through each deployment before measuring"
    )
    add_workload_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_compare_command(args: argparse.Namespace) -> int:
    """``tandem bench compare``: 0 once every preset ran (whatever the ratio), 2 for a bad option."""
    topologies = check_presets(args.presets.split(","))
    plan = plan_from_args(args)
    result = run_compare(topologies, args.cores_per_rank, plan, args.model, args.dtype, args.warmup)
    emit(to_json(result) if args.json else format_compare(result))
    return 0


def format_compare(result: dict[str, Any]) -> str:
    """A table of the presets' figures, then the ratio."""
    slo = result["slo"]
    lines = [
        f"SLO: TTFT <= {slo['ttft_ms']:g} ms and mean ITL <= {slo['itl_ms']:g} ms; "
        f"{result['cores_per_rank']} core(s) per rank of {result['machine_cores']}",
        f"{'preset':<12} {'topology':<34} {'done':>6} {'req/s':>7} {'goodput':>8} "
        f"{'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8}",
    ]
    for name, run in result["runs"].items():
        points = run["points"]
        done = sum(p["completed"] for p in points)
        sent = sum(p["requests"] for p in points)
        wall = sum(p["wall_s"] for p in points)
        p = points[-1]
        lines.append(
            f"{name:<12} {run['topology']:<34} {f'{done}/{sent}':>6} {done / wall:>7.3f} "
            f"{result['goodput_rps'][name]:>8.3f} {p['ttft_ms']['p50']:>9.1f} {p['ttft_ms']['p99']:>9.1f} "
            f"{p['itl_ms']['p50']:>8.1f} {p['itl_ms']['p99']:>8.1f}"
        )
    for name, ratio in result["ratios"].items():
        shown = "n/a (colocated met no SLO)" if ratio is None else f"{ratio:.2f}"
        lines.append(f"goodput {name} / {result['colocated']}: {shown}")
    return "\n".join(lines)
