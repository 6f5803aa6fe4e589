"""``tandem bench``: each benchmark a command of its own (its name, help, arguments and what it
runs), in one table that builds the parsers and dispatches."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.cli.errors import CliError
from tandem.client.output import emit
from tandem.wire.request_params import InvalidRequestError


def _engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--batch-sizes", default="1,32")
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; else top_p 0.95 too")
    p.add_argument("--json", action="store_true")


def _run_engine(args: argparse.Namespace) -> int:
    from tandem.bench.engine_bench import run_engine_bench

    result = run_engine_bench(
        args.model,
        dtype=args.dtype,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
        temperature=args.temperature,
    )
    emit(json.dumps(result, indent=None if args.json else 2))
    return 0


def _dep_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--sizes", default="1,2,4", help="DEP sizes to run, comma-separated")
    p.add_argument("--requests-per-rank", type=int, default=4)
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: start Ray here)")
    p.add_argument("--json", action="store_true")


def _run_dep(args: argparse.Namespace) -> int:
    from tandem.bench.dep_bench import run_dep_bench

    result = run_dep_bench(
        args.model,
        [int(n) for n in args.sizes.split(",")],
        args.requests_per_rank,
        args.prompt_tokens,
        args.output_tokens,
        args.dtype,
        args.address,
    )
    emit(json.dumps(result, indent=None if args.json else 2))
    return 0


def _disagg_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--preset", default="local")
    p.add_argument("--concurrency", default="1,16", help="comma-separated")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--address", default=None, help="Ray cluster to join (default: start Ray here)")
    p.add_argument("--json", action="store_true")


def _run_disagg(args: argparse.Namespace) -> int:
    from tandem.bench.disagg_bench import run_disagg_bench

    result = run_disagg_bench(
        args.model,
        args.preset,
        [int(c) for c in args.concurrency.split(",")],
        args.requests,
        args.prompt_tokens,
        args.output_tokens,
        address=args.address,
    )
    emit(json.dumps(result, indent=None if args.json else 2))
    return 0


def _autoscale_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--trace", type=Path, action="append", default=[], help="Mooncake-format JSONL trace (repeatable)"
    )
    p.add_argument(
        "--shape",
        action="append",
        default=[],
        choices=["long-prompt", "bursty-short"],
        help="a generated trace (repeatable; default with no --trace: both)",
    )
    p.add_argument("--rate-swing", type=float, default=4.0, help="peak / trough arrival rate of the replay")
    p.add_argument("--time-scale", type=float, default=None, help="--trace arrivals this many times denser")
    p.add_argument("--ttft-slo", type=float, default=3.0, help="seconds")
    p.add_argument("--itl-slo", type=float, default=0.1, help="seconds")
    p.add_argument("--rank-budget", type=int, default=48)
    p.add_argument("--max-groups", type=int, default=8, help="per pool")
    p.add_argument("--json", action="store_true")


def _run_autoscale(args: argparse.Namespace) -> int:
    from tandem.bench import autoscale_report, autoscale_sim
    from tandem.bench.router_bench import TraceError, read_trace

    if not args.rate_swing >= 1:
        raise InvalidRequestError("--rate-swing", f"must be >= 1, got {args.rate_swing}")
    if args.time_scale is not None and not args.time_scale > 0:
        raise InvalidRequestError("--time-scale", f"must be > 0, got {args.time_scale}")
    try:
        config = autoscale_sim.bench_config(
            rank_budget=args.rank_budget,
            max_groups=args.max_groups,
            ttft_slo_s=args.ttft_slo,
            itl_slo_s=args.itl_slo,
        )
    except ValueError as exc:
        raise InvalidRequestError("--ttft-slo/--itl-slo/--rank-budget/--max-groups", str(exc)) from None
    traces: list[tuple[str, list[Any], float]] = []
    for path in args.trace:
        try:
            traces.append((str(path), read_trace(path), args.time_scale or 1.0))
        except TraceError as exc:
            raise CliError(str(exc)) from exc
    for shape in args.shape or ([] if args.trace else ["long-prompt", "bursty-short"]):
        traces.append((shape, autoscale_sim.generated_trace(shape), 1.0))
    results = []
    for name, requests, scale in traces:
        swing = args.rate_swing
        result = autoscale_sim.run_autoscale_bench(requests, config, swing=swing, time_scale=scale)
        results.append({"trace": name, **result})
    emit(json.dumps(results) if args.json else autoscale_report.format_report(results, config))
    return 0


def _metrics_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--preset", default="local")
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=4, help="pairs of batches, one on and one off")
    p.add_argument("--address", default=None, help="Ray cluster to join (default: start Ray here)")
    p.add_argument("--json", action="store_true")


def _run_metrics(args: argparse.Namespace) -> int:
    from tandem.bench.metrics_bench import run_metrics_bench

    for flag in ("requests", "prompt_tokens", "output_tokens", "rounds"):
        if getattr(args, flag) < 1:
            raise InvalidRequestError(f"--{flag.replace('_', '-')}", "must be at least 1")
    result = run_metrics_bench(
        args.model, args.preset, args.requests, args.prompt_tokens, args.output_tokens, args.rounds,
        args.address,
    )  # fmt: skip
    emit(json.dumps(result, indent=None if args.json else 2))
    return 0


def _kvtransfer_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size-mib", type=int, default=256)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--address", default=None, help="Ray cluster to join (default: start Ray here)")
    p.add_argument("--json", action="store_true")


def _run_kvtransfer(args: argparse.Namespace) -> int:
    from tandem.bench.kvtransfer_bench import run_kvtransfer_bench

    if args.size_mib < 1:
        raise InvalidRequestError("--size-mib", f"must be at least 1, got {args.size_mib}")
    result = run_kvtransfer_bench(args.size_mib, args.repeats, args.address)
    emit(json.dumps(result, indent=None if args.json else 2))
    return 0


def _soak_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny model)")
    p.add_argument("--preset", default="local")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--cancel-fraction", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)


def _run_soak(args: argparse.Namespace) -> int:
    from tandem.bench.soak import SoakConfig, run_soak

    if args.requests < 1 or args.concurrency < 1:
        flag = "--requests" if args.requests < 1 else "--concurrency"
        raise InvalidRequestError(flag, "must be at least 1")
    if not 0 <= args.cancel_fraction <= 1:
        raise InvalidRequestError("--cancel-fraction", f"must be in [0, 1], got {args.cancel_fraction}")
    if args.model is not None:
        from tandem.model.checkpoint import check_model_dir

        check_model_dir(args.model)
    soak_config = SoakConfig(
        requests=args.requests,
        concurrency=args.concurrency,
        cancel_fraction=args.cancel_fraction,
        seed=args.seed,
        preset=args.preset,
    )
    soak_result = run_soak(soak_config, args.model)
    emit(json.dumps(soak_result))
    return 0 if soak_result["ok"] else 1


def _router_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    p.add_argument("--prefill-ranks", type=int, default=8)
    p.add_argument("--capacity-blocks", type=int, default=None, help="per-rank cache, 512-token blocks")
    p.add_argument("--prefill-tokens-per-s", type=float, default=None, help="uncached tokens/s per rank")
    p.add_argument("--policy", default=None, help="prefill policy (default cache_aware)")
    p.add_argument("--host-capacity-blocks", type=int, default=None, help="per-rank host LRU (default none)")
    p.add_argument("--store", action="store_true", help="a store shared by all ranks (side by side)")
    p.add_argument("--store-capacity-blocks", type=int, default=None, help="store LRU (default unbounded)")
    p.add_argument("--host-load-tokens-per-s", type=float, default=None, help="host to device, per rank")
    p.add_argument("--store-load-tokens-per-s", type=float, default=None, help="store to device, per rank")
    p.add_argument("--json", action="store_true")


def _run_router(args: argparse.Namespace) -> int:
    from tandem.bench import router_bench

    options = {
        "capacity_blocks": args.capacity_blocks,
        "prefill_tokens_per_s": args.prefill_tokens_per_s,
        "policy": args.policy,
        "host_capacity_blocks": args.host_capacity_blocks,
        "store": args.store or None,
        "store_capacity_blocks": args.store_capacity_blocks,
        "host_load_tokens_per_s": args.host_load_tokens_per_s,
        "store_load_tokens_per_s": args.store_load_tokens_per_s,
    }
    try:
        result = router_bench.run_router_bench(
            args.trace, args.prefill_ranks, **{k: v for k, v in options.items() if v is not None}
        )
    except ValueError as exc:  # TraceError, a bad option or an unknown policy
        raise CliError(str(exc)) from exc
    emit(json.dumps(result) if args.json else router_bench.format_report(result))
    return 0


def _trace_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", choices=["long-prompt", "bursty-short"], default="long-prompt")
    p.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--duration-s", type=float, default=None, help="arrivals span (default 1,800 s)")


def _run_trace(args: argparse.Namespace) -> int:
    from tandem.bench import trace_gen

    try:
        options = {
            "seed": args.seed,
            **({} if args.duration_s is None else {"duration_s": args.duration_s}),
        }
        records = (
            trace_gen.long_prompt_trace(trace_gen.LongPromptShape(**options))
            if args.shape == "long-prompt"
            else trace_gen.bursty_short_trace(trace_gen.BurstyShortShape(**options))
        )
        stats = trace_gen.write_trace(args.out, records)
    except (ValueError, OSError) as exc:
        raise CliError(str(exc)) from exc
    emit(json.dumps({"trace": str(args.out), **stats}))
    return 0


def _host_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.bench.host_bench import add_arguments

    add_arguments(p)


def _run_host(args: argparse.Namespace) -> int:
    from tandem.bench.host_bench import run_host_command

    return run_host_command(args, emit)


def _serve_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.bench.serve_bench import add_arguments

    add_arguments(p)


def _run_serve(args: argparse.Namespace) -> int:
    from tandem.bench.serve_bench import run_serve_bench

    return run_serve_bench(args)


def _compare_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.bench.compare import add_arguments

    add_arguments(p)


def _run_compare(args: argparse.Namespace) -> int:
    from tandem.bench.compare import run_compare_command

    return run_compare_command(args)


def _speculative_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.bench.spec_bench import add_arguments

    add_arguments(p)


def _run_speculative(args: argparse.Namespace) -> int:
    from tandem.bench.spec_bench import run_speculative_command

    return run_speculative_command(args)


def _start_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.bench.start_bench import add_arguments

    add_arguments(p)


def _run_start(args: argparse.Namespace) -> int:
    from tandem.bench.start_bench import run_start_command

    return run_start_command(args)


def _tiers_arguments(p: argparse.ArgumentParser) -> None:
    from tandem.bench.tier_bench import add_arguments

    add_arguments(p)


def _run_tiers(args: argparse.Namespace) -> int:
    from tandem.bench.tier_bench import run_tiers_command
    from tandem.cli.serving import fit_v4_deployment

    return run_tiers_command(args, lambda topology: fit_v4_deployment(topology, args.model))


@dataclass(frozen=True)
class BenchCommand:
    name: str
    help: str
    arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], int]


# in the order `tandem bench --help` lists them
BENCH_COMMANDS = (
    BenchCommand("engine", "colocated engine throughput at batch 1 and 32", _engine_arguments, _run_engine),
    BenchCommand("dep", "per-step time of DEP groups, all-to-all time apart", _dep_arguments, _run_dep),
    BenchCommand("disagg", "TTFT and ITL: disaggregated against colocated", _disagg_arguments, _run_disagg),
    BenchCommand(
        "autoscale",
        "the autoscaler on a simulated cluster against static sizes",
        _autoscale_arguments,
        _run_autoscale,
    ),
    BenchCommand(
        "metrics",
        "decode throughput with metrics (and scrapes) on against off",
        _metrics_arguments,
        _run_metrics,
    ),
    BenchCommand(
        "kvtransfer",
        "NIXL transfer speed between two actors against memcpy",
        _kvtransfer_arguments,
        _run_kvtransfer,
    ),
    BenchCommand(
        "soak",
        "many requests, some cancelled: exact tokens, no leak, flat memory",
        _soak_arguments,
        _run_soak,
    ),
    BenchCommand(
        "router",
        "Mooncake trace through the router over simulated prefill ranks",
        _router_arguments,
        _run_router,
    ),
    BenchCommand(
        "trace",
        "write a generated Mooncake-format trace (bench router's input)",
        _trace_arguments,
        _run_trace,
    ),
    BenchCommand("host", "host-path costs: decode overhead, frontend, transfer", _host_arguments, _run_host),
    BenchCommand("serve", "benchmark a running deployment over gRPC", _serve_arguments, _run_serve),
    BenchCommand(
        "compare",
        "goodput of a colocated and a disaggregated preset, same cores",
        _compare_arguments,
        _run_compare,
    ),
    BenchCommand(
        "speculative",
        "speculative decoding against plain, side by side",
        _speculative_arguments,
        _run_speculative,
    ),
    BenchCommand(
        "start",
        "serve-to-SERVING and first requests, groups one by one vs at once",
        _start_arguments,
        _run_start,
    ),
    BenchCommand("tiers", "KV tiers off against on, served side by side", _tiers_arguments, _run_tiers),
)


def add_bench_parsers(sub: Any) -> None:
    """``tandem bench`` and each benchmark's parser, from ``BENCH_COMMANDS``."""
    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    for command in BENCH_COMMANDS:
        command.arguments(bench.add_parser(command.name, help=command.help))


def run_bench(args: argparse.Namespace) -> int:
    """The benchmark ``args`` names."""
    for command in BENCH_COMMANDS:
        if command.name == args.bench_command:
            return command.run(args)
    raise CliError(f"unknown benchmark {args.bench_command}")
