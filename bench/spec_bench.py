"""Speculative decoding against plain decoding, side by side: ``tandem bench speculative``.

Each configuration (``off``, ``mtp:K``, ``ngram:K``) of one topology runs in turn on an embedded
Ray in this process, as ``tandem bench compare`` runs presets: the same model and cores, a few
warm-up requests, then the same workload as ``tandem bench serve`` over gRPC (a text workload,
``--prompts-file``, is the one that means anything: random token ids make every drafter look
useless). ``--rounds`` repeats the whole set, in a rotated order each round, so the machine's
drift falls on every configuration alike. Per configuration and point it reports output tokens
a second per user (1000 / median TPOT), its ratio to ``off`` of the same round, the mean
acceptance length from the bills (output tokens per decode step), the ITL, and the decode
ranks' own mean step: its whole, the forward (the verify step) and the drafter::

    for round in rounds:  for config in rotated(configs):
        Server(topology + speculative) -> warm-up -> run_plan(plan) -> stop
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
from pathlib import Path
from typing import Any

import ray

from tandem.bench.compare import served
from tandem.bench.serve_bench import Plan, add_workload_arguments, plan_from_args, run_plan
from tandem.bench.serve_report import to_json
from tandem.client.grpc_client import ClientOptions
from tandem.client.output import emit
from tandem.cluster.serve import Server
from tandem.cluster.topology import SpeculativeSpec, Topology, TopologyError
from tandem.engine.speculation import DRAFTERS, MAX_SPECULATIVE_TOKENS
from tandem.wire.messages import RankStats, Role
from tandem.wire.request_params import InvalidRequestError


def parse_configs(value: str) -> dict[str, SpeculativeSpec]:
    """``off,mtp:3,ngram:3`` -> each configuration by its name; an error names ``--configs``."""
    configs: dict[str, SpeculativeSpec] = {}
    for name in (part.strip() for part in value.split(",") if part.strip()):
        if name == "off":
            configs[name] = SpeculativeSpec()
            continue
        drafter, _, k = name.partition(":")
        if drafter not in DRAFTERS or not k.isdigit() or not 1 <= int(k) <= MAX_SPECULATIVE_TOKENS:
            raise InvalidRequestError(
                "--configs",
                f"expected off or DRAFTER:K (drafter {'/'.join(DRAFTERS)}, K 1..16), got {name!r}",
            )
        configs[name] = SpeculativeSpec(tokens=int(k), drafter=drafter)
    if "off" not in configs or len(configs) < 2:
        raise InvalidRequestError("--configs", f"expected off and at least one drafter, got {value!r}")
    return configs


def run_one(
    topology: Topology, plan: Plan, model_dir: Path | None, dtype: str, warmup: int
) -> dict[str, Any]:
    """One configuration's run, with its decode ranks' own step split over the measured part:
    per step, the verify forward and the drafter, each timed on the rank's clock."""
    pinned = topology.model_copy(update={"pin_cores_per_rank": 1})
    with served(pinned, model_dir, dtype, warmup) as server:
        before = _decode_stats(server)
        result = asyncio.run(run_plan(ClientOptions(f"127.0.0.1:{server.port}"), plan))
        after = _decode_stats(server)
    return {"topology": pinned.describe(), **result, "decode_step": _split(before, after)}


def _decode_stats(server: Server) -> list[RankStats]:
    stats: list[RankStats] = ray.get(server.controller.stats.remote())
    return sorted((s for s in stats if s.role is Role.DECODE), key=lambda s: s.rank)


def _split(before: list[RankStats], after: list[RankStats]) -> dict[str, float]:
    """Milliseconds per step of the decode ranks' loops, the mean over the ranks."""
    steps = sum(a.loop.steps - b.loop.steps for a, b in zip(after, before, strict=True))
    if steps <= 0:
        return {"steps": 0}

    def ms(part: str) -> float:
        total = sum(
            getattr(a.split, part) - getattr(b.split, part) for a, b in zip(after, before, strict=True)
        )
        return round(1e3 * total / steps, 3)

    step_s = sum(a.loop.step_s - b.loop.step_s for a, b in zip(after, before, strict=True))
    return {
        "steps": steps / len(after),
        "step_ms": round(1e3 * step_s / steps, 3),
        "forward_ms": ms("forward_s"),
        "draft_ms": ms("draft_s"),
        "sample_ms": ms("sample_s"),
    }


def run_speculative(
    topology: Topology,
    configs: dict[str, SpeculativeSpec],
    plan: Plan,
    rounds: int,
    model_dir: Path | None,
    dtype: str,
    warmup: int,
) -> dict[str, Any]:
    """Every configuration ``rounds`` times; the ``--json`` object."""
    if rounds < 1:
        raise InvalidRequestError("--rounds", f"must be at least 1, got {rounds}")
    names = list(configs)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names) :] + names[: r % len(names)]:
            spec_topology = topology.model_copy(update={"speculative": configs[name]})
            runs[name].append(run_one(spec_topology, plan, model_dir, dtype, warmup))
    return {
        "topology": topology.describe(),
        "rounds": rounds,
        "configs": names,
        "points": _points(runs),
        "runs": runs,
    }


def _points(runs: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """Per configuration and point: the means over rounds, and each round's ratio to ``off``."""
    out = []
    base = runs["off"]
    for name, rounds in runs.items():
        for i, point in enumerate(rounds[0]["points"]):
            per_round = [run["points"][i] for run in rounds]
            user = [p["interactivity_tokens_per_s"] for p in per_round]
            ratios = [
                p["interactivity_tokens_per_s"] / b["points"][i]["interactivity_tokens_per_s"]
                for p, b in zip(per_round, base, strict=True)
                if b["points"][i]["interactivity_tokens_per_s"] > 0
            ]
            out.append(
                {
                    "config": name,
                    "concurrency": point["concurrency"],
                    "tokens_per_s_per_user": statistics.fmean(user),
                    "ratio_to_off": statistics.fmean(ratios) if ratios else None,
                    "ratios_to_off": ratios,
                    "acceptance_length": statistics.fmean(
                        p["speculation"]["acceptance_length"] for p in per_round
                    ),
                    "acceptance_rate": statistics.fmean(
                        p["speculation"]["acceptance_rate"] for p in per_round
                    )
                    if name != "off"
                    else None,
                    "itl_p50_ms": statistics.fmean(p["itl_ms"]["p50"] for p in per_round),
                    "tpot_p50_ms": statistics.fmean(p["tpot_ms"]["p50"] for p in per_round),
                    "ttft_p50_ms": statistics.fmean(p["ttft_ms"]["p50"] for p in per_round),
                    "output_tokens_per_s": statistics.fmean(p["output_tokens_per_s"] for p in per_round),
                    "failed": sum(p["failed"] for p in per_round),
                    "decode_step_ms": statistics.fmean(
                        run["decode_step"].get("step_ms", 0.0) for run in rounds
                    ),
                    "decode_forward_ms": statistics.fmean(
                        run["decode_step"].get("forward_ms", 0.0) for run in rounds
                    ),
                    "decode_draft_ms": statistics.fmean(
                        run["decode_step"].get("draft_ms", 0.0) for run in rounds
                    ),
                }
            )
    return out


def format_speculative(result: dict[str, Any]) -> str:
    lines = [
        f"{result['topology']}; means over {result['rounds']} round(s), each ratio to off within its round",
        f"{'config':<10} {'C':>3} {'tok/s/user':>10} {'x off':>6} {'accept len':>10} {'accept rate':>11} "
        f"{'ITL p50 ms':>10} {'TPOT p50 ms':>11} {'TTFT p50 ms':>11} {'out tok/s':>9} {'failed':>6}"
        f" {'step ms':>8} {'forward':>8} {'draft':>6}",
    ]
    for p in result["points"]:
        ratio = "-" if p["ratio_to_off"] is None else f"{p['ratio_to_off']:.2f}"
        rate = "-" if p["acceptance_rate"] is None else f"{p['acceptance_rate']:.2f}"
        length = p["acceptance_length"]
        length = "-" if length is None or length != length else f"{length:.2f}"  # NaN: no decode step
        lines.append(
            f"{p['config']:<10} {p['concurrency']:>3} {p['tokens_per_s_per_user']:>10.1f} {ratio:>6} "
            f"{length:>10} {rate:>11} {p['itl_p50_ms']:>10.1f} {p['tpot_p50_ms']:>11.1f} "
            f"{p['ttft_p50_ms']:>11.1f} {p['output_tokens_per_s']:>9.1f} {p['failed']:>6}"
            f" {p['decode_step_ms']:>8.2f} {p['decode_forward_ms']:>8.2f} {p['decode_draft_ms']:>6.2f}"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", default="local", help="topology preset (its speculative block is replaced)"
    )
    parser.add_argument("--configs", default="off,mtp:3,ngram:3", help="off and DRAFTER:K, comma-separated")
    parser.add_argument("--rounds", type=int, default=2, help="times each configuration runs, rotated")
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16", "float64"])
    parser.add_argument("--warmup", type=int, default=4, help="requests through each deployment first")
    add_workload_arguments(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_speculative_command(args: argparse.Namespace) -> int:
    try:
        topology = Topology.preset(args.preset)
    except TopologyError as exc:
        raise InvalidRequestError("--preset", exc.message) from None
    configs = parse_configs(args.configs)
    plan = plan_from_args(args)
    result = run_speculative(topology, configs, plan, args.rounds, args.model, args.dtype, args.warmup)
    emit(to_json(result) if args.json else format_speculative(result))
    return 0
