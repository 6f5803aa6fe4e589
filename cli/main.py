"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from tandem.client.output import command_output, emit
from tandem.client.prompts import PromptSpec
from tandem.engine.engine_config import EngineConfig
from tandem.wire.messages import CachedByTier
from tandem.wire.request_params import Guide, GuideKind, InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from tandem.model.tokenizer import Tokenizer


class CliError(Exception):
    """A problem the user can fix; printed as one line, exit code 2."""


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, required=True, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    parser.add_argument("--seed", type=int, default=None, help="per-request seed for sampling")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")
    structure = parser.add_mutually_exclusive_group()
    structure.add_argument(
        "--json-schema", type=Path, default=None, help="a JSON Schema file: the output follows it"
    )
    structure.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    structure.add_argument("--regex", default=None, help="the output matches this regular expression")
    structure.add_argument("--grammar", type=Path, default=None, help="an EBNF file (start rule root)")


def _sampling(args: argparse.Namespace) -> SamplingParams:
    """The sampling options of ``_sampling_args``, validated."""
    sampling = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        guide=_guide(args),
    )
    sampling.validate()
    return sampling


def _guide(args: argparse.Namespace) -> Guide | None:
    """The structured output the options ask for; a file that cannot be read names its flag."""
    if args.json_object:
        return Guide(GuideKind.JSON_OBJECT)
    if args.regex is not None:
        return Guide(GuideKind.REGEX, args.regex)
    for flag, path, kind in (("--json-schema", args.json_schema, GuideKind.JSON_SCHEMA),
                             ("--grammar", args.grammar, GuideKind.GRAMMAR)):  # fmt: skip
        if path is None:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise InvalidRequestError(flag, f"cannot read {path}: {exc}") from None
        if kind is GuideKind.JSON_SCHEMA:
            try:
                json.loads(text)
            except json.JSONDecodeError as exc:
                raise InvalidRequestError(flag, f"{path} is not JSON: {exc}") from None
        return Guide(kind, text)
    return None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated DeepSeek-V3 serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model utilities").add_subparsers(
        dest="model_command", required=True
    )
    tiny = model.add_parser("make-tiny", help="write a tiny random DeepSeek-V3 checkpoint")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument("--mtp", action="store_true", help="add a (random) multi-token-prediction layer")
    tiny.add_argument(
        "--fp8-block",
        type=int,
        default=None,
        metavar="B",
        help="write it in DeepSeek-V3's FP8 format with B x B block scales (the release uses 128)",
    )
    demo = model.add_parser("train-demo", help="train the tiny model on English text (the default model)")
    demo.add_argument("dir", type=Path, help="where to write the checkpoint (the committed one: model/demo)")
    demo.add_argument("--corpus", type=Path, default=None, help="UTF-8 text (default: model/demo/corpus.txt)")
    demo.add_argument("--steps", type=int, default=None, help="optimizer steps (default 1400)")
    demo.add_argument("--seed", type=int, default=0, help="initialisation and batch order")
    demo.add_argument(
        "--mtp-steps", type=int, default=None, help="MTP layer steps after (default 600; 0: none)"
    )
    demo.add_argument(
        "--mtp-only",
        action="store_true",
        help="train only the MTP layer of the checkpoint already in DIR (its model's weights kept)",
    )

    gen = sub.add_parser("generate", help="generate with the colocated engine")
    gen.add_argument(
        "--model",
        type=Path,
        default=None,
        help="model directory (default: the demo model the project trains)",
    )
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text")
    src.add_argument("--prompt-ids", help="comma-separated prompt token ids")
    src.add_argument("--prompts-file", type=Path, help="JSONL, one prompt object a line")
    _sampling_args(gen)
    gen.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"], default="float32")
    gen.add_argument("--page-size", type=int, default=64)
    gen.add_argument("--num-pages", type=int, default=None, help="KV pool size in pages")
    gen.add_argument("--json", action="store_true", help="print one JSON object")
    gen.add_argument("--dep", type=int, default=None, help="run as one DEP group of this many Ray actors")
    gen.add_argument("--preset", default=None, help="run disaggregated on a topology of deploy/presets")
    gen.add_argument("--topology", type=Path, default=None, help="run disaggregated on this topology file")
    gen.add_argument("--address", default=None, help="Ray cluster to join (default: start Ray here)")
    from tandem.cli.serving import add_speculative_arguments, add_tier_arguments

    add_speculative_arguments(gen)
    add_tier_arguments(gen)

    from tandem.cli.serving import add_serving_parsers

    add_serving_parsers(sub, _sampling_args)
    from tandem.cli.deployment import add_deployment_parsers

    add_deployment_parsers(sub)
    from tandem.cli.plan import add_plan_parsers

    add_plan_parsers(sub)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench_command", required=True)
    eng = bench.add_parser("engine", help="colocated engine throughput at batch 1 and 32")
    eng.add_argument("--model", type=Path, required=True)
    eng.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    eng.add_argument("--prompt-tokens", type=int, default=64)
    eng.add_argument("--output-tokens", type=int, default=64)
    eng.add_argument("--batch-sizes", default="1,32")
    eng.add_argument("--temperature", type=float, default=0.0, help="0 is greedy; else top_p 0.95 too")
    eng.add_argument("--json", action="store_true")
    dep = bench.add_parser("dep", help="per-step time of DEP groups, all-to-all time apart")
    dep.add_argument("--model", type=Path, required=True)
    dep.add_argument("--sizes", default="1,2,4", help="DEP sizes to run, comma-separated")
    dep.add_argument("--requests-per-rank", type=int, default=4)
    dep.add_argument("--prompt-tokens", type=int, default=32)
    dep.add_argument("--output-tokens", type=int, default=32)
    dep.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    dep.add_argument("--address", default=None, help="Ray cluster to join (default: start Ray here)")
    dep.add_argument("--json", action="store_true")
    dis = bench.add_parser("disagg", help="TTFT and ITL: disaggregated against colocated")
    dis.add_argument("--model", type=Path, required=True)
    dis.add_argument("--preset", default="local")
    dis.add_argument("--concurrency", default="1,16", help="comma-separated")
    dis.add_argument("--requests", type=int, default=16)
    dis.add_argument("--prompt-tokens", type=int, default=128)
    dis.add_argument("--output-tokens", type=int, default=16)
    dis.add_argument("--address", default=None, help="Ray cluster to join (default: start Ray here)")
    dis.add_argument("--json", action="store_true")
    asc = bench.add_parser("autoscale", help="the autoscaler on a simulated cluster against static sizes")
    asc.add_argument(
        "--trace", type=Path, action="append", default=[], help="Mooncake-format JSONL trace (repeatable)"
    )
    asc.add_argument(
        "--shape",
        action="append",
        default=[],
        choices=["long-prompt", "bursty-short"],
        help="a generated trace (repeatable; default with no --trace: both)",
    )
    asc.add_argument("--rate-swing", type=float, default=4.0, help="peak / trough arrival rate of the replay")
    asc.add_argument("--time-scale", type=float, default=None, help="--trace arrivals this many times denser")
    asc.add_argument("--ttft-slo", type=float, default=3.0, help="seconds")
    asc.add_argument("--itl-slo", type=float, default=0.1, help="seconds")
    asc.add_argument("--rank-budget", type=int, default=48)
    asc.add_argument("--max-groups", type=int, default=8, help="per pool")
    asc.add_argument("--json", action="store_true")
    met = bench.add_parser("metrics", help="decode throughput with metrics (and scrapes) on against off")
    met.add_argument("--model", type=Path, required=True)
    met.add_argument("--preset", default="local")
    met.add_argument("--requests", type=int, default=16)
    met.add_argument("--prompt-tokens", type=int, default=64)
    met.add_argument("--output-tokens", type=int, default=64)
    met.add_argument("--rounds", type=int, default=4, help="pairs of batches, one on and one off")
    met.add_argument("--address", default=None, help="Ray cluster to join (default: start Ray here)")
    met.add_argument("--json", action="store_true")
    kv = bench.add_parser("kvtransfer", help="NIXL transfer speed between two actors against memcpy")
    kv.add_argument("--size-mib", type=int, default=256)
    kv.add_argument("--repeats", type=int, default=3)
    kv.add_argument("--address", default=None, help="Ray cluster to join (default: start Ray here)")
    kv.add_argument("--json", action="store_true")
    soak = bench.add_parser("soak", help="many requests, some cancelled: exact tokens, no leak, flat memory")
    soak.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny model)")
    soak.add_argument("--preset", default="local")
    soak.add_argument("--requests", type=int, default=1000)
    soak.add_argument("--concurrency", type=int, default=16)
    soak.add_argument("--cancel-fraction", type=float, default=0.05)
    soak.add_argument("--seed", type=int, default=0)
    rb = bench.add_parser("router", help="Mooncake trace through the router over simulated prefill ranks")
    rb.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    rb.add_argument("--prefill-ranks", type=int, default=8)
    rb.add_argument("--capacity-blocks", type=int, default=None, help="per-rank cache, 512-token blocks")
    rb.add_argument("--prefill-tokens-per-s", type=float, default=None, help="uncached tokens/s per rank")
    rb.add_argument("--policy", default=None, help="prefill policy (default cache_aware)")
    rb.add_argument("--host-capacity-blocks", type=int, default=None, help="per-rank host LRU (default none)")
    rb.add_argument("--store", action="store_true", help="a store shared by all ranks (side by side)")
    rb.add_argument("--store-capacity-blocks", type=int, default=None, help="store LRU (default unbounded)")
    rb.add_argument("--host-load-tokens-per-s", type=float, default=None, help="host to device, per rank")
    rb.add_argument("--store-load-tokens-per-s", type=float, default=None, help="store to device, per rank")
    rb.add_argument("--json", action="store_true")
    tg = bench.add_parser("trace", help="write a generated Mooncake-format trace (bench router's input)")
    tg.add_argument("--shape", choices=["long-prompt", "bursty-short"], default="long-prompt")
    tg.add_argument("--out", type=Path, required=True, help="JSONL file to write")
    tg.add_argument("--seed", type=int, default=0)
    tg.add_argument("--duration-s", type=float, default=None, help="arrivals span (default 1,800 s)")
    from tandem.bench.host_bench import add_arguments as add_host_arguments

    add_host_arguments(bench.add_parser("host", help="host-path costs: decode overhead, frontend, transfer"))
    from tandem.bench.serve_bench import add_arguments as add_serve_bench_arguments

    add_serve_bench_arguments(bench.add_parser("serve", help="benchmark a running deployment over gRPC"))
    from tandem.bench.compare import add_arguments as add_compare_arguments

    add_compare_arguments(
        bench.add_parser("compare", help="goodput of a colocated and a disaggregated preset, same cores")
    )
    from tandem.bench.spec_bench import add_arguments as add_spec_arguments

    add_spec_arguments(
        bench.add_parser("speculative", help="speculative decoding against plain, side by side")
    )
    from tandem.bench.start_bench import add_arguments as add_start_arguments

    add_start_arguments(
        bench.add_parser("start", help="serve-to-SERVING and first requests, groups one by one vs at once")
    )
    from tandem.bench.tier_bench import add_arguments as add_tier_bench_arguments

    add_tier_bench_arguments(bench.add_parser("tiers", help="KV tiers off against on, served side by side"))
    return parser


def main(argv: list[str] | None = None) -> int:
    from tandem.cluster.topology import TopologyError
    from tandem.model.errors import ModelFileError
    from tandem.model.kernels.registry import UnknownKernelBackend
    from tandem.model.make_tiny import TinyCheckpointError

    args = build_parser().parse_args(argv)
    try:
        with command_output(whole_process=argv is None):  # None: run as the tandem command
            return _dispatch(args)
    except (
        TopologyError,
        CliError,
        InvalidRequestError,
        ModelFileError,
        TinyCheckpointError,
        UnknownKernelBackend,
    ) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


def _train_demo(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from tandem.model import train_demo as td

    settings = td.TrainSettings(seed=args.seed)
    if args.steps is not None:
        if args.steps < 1:
            raise CliError(f"--steps: expected a positive integer, got {args.steps}")
        settings = replace(settings, steps=args.steps)
    if args.mtp_steps is not None:
        if args.mtp_steps < 0 or (args.mtp_only and args.mtp_steps < 1):
            raise CliError(f"--mtp-steps: expected an integer >= {int(args.mtp_only)}, got {args.mtp_steps}")
        settings = replace(settings, mtp_steps=args.mtp_steps)
    corpus = args.corpus or td.DEMO_CORPUS
    if not corpus.is_file():
        raise CliError(f"--corpus: {corpus} is not a file")
    if args.mtp_only and not (args.dir / "config.json").is_file():
        raise CliError(f"--mtp-only: {args.dir} holds no checkpoint (config.json)")
    log = lambda line: print(line, file=sys.stderr)  # noqa: E731
    try:
        if args.mtp_only:
            result = td.train_demo_mtp(args.dir, corpus, settings, log=log)
        else:
            result = td.train_demo(args.dir, corpus, settings, log=log)
    except td.TrainingDependencyMissing as exc:
        raise CliError(str(exc)) from exc
    if settings.mtp_steps:
        emit(
            f"MTP layer: {settings.mtp_steps} steps in {result.mtp_wall_s:.0f} s, held-out next-next-byte "
            f"loss {result.mtp_eval_bits:.2f} bits per character"
        )
    if args.mtp_only:
        emit(f"wrote the demo checkpoint to {result.out_dir}, its model's weights as they were")
        return 0
    emit(
        f"wrote the demo checkpoint to {result.out_dir}: {settings.steps} steps in {result.wall_s:.0f} s, "
        f"held-out loss {result.initial_eval_bits:.2f} -> {result.eval_bits:.2f} bits per character"
    )
    return 0


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "model" and args.model_command == "train-demo":
        return _train_demo(args)
    if args.command == "model":
        from tandem.model.make_tiny import make_tiny_checkpoint

        extra = {"num_nextn_predict_layers": 1} if args.mtp else {}
        block = (args.fp8_block, args.fp8_block) if args.fp8_block else None
        path = make_tiny_checkpoint(args.dir, seed=args.seed, fp8_block=block, **extra)
        emit(f"wrote tiny DeepSeek-V3 checkpoint to {path}")
        return 0
    if args.command == "generate":
        if args.model is None:
            from tandem.cluster.serve import demo_model_dir

            args.model = demo_model_dir()
        return _generate(args)
    if args.command in ("serve", "client"):
        from tandem.cli.serving import run_client, run_serve

        return run_serve(args) if args.command == "serve" else run_client(args, _sampling)
    if args.command in ("status", "stop"):
        from tandem.cli.deployment import DeploymentUnreachable, run_status, run_stop

        try:
            return run_status(args) if args.command == "status" else run_stop(args)
        except DeploymentUnreachable as exc:
            print(f"tandem: error: {exc}", file=sys.stderr)
            return 1
    if args.command == "plan":
        from tandem.cli.plan import run_plan_memory

        return run_plan_memory(args)
    if args.command == "metrics":
        from tandem.cli.serving import run_metrics

        return run_metrics(args)
    if args.command == "bench" and args.bench_command == "disagg":
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
    if args.command == "bench" and args.bench_command == "autoscale":
        from tandem.bench import autoscale_sim
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
        emit(json.dumps(results) if args.json else autoscale_sim.format_report(results, config))
        return 0
    if args.command == "bench" and args.bench_command == "metrics":
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
    if args.command == "bench" and args.bench_command == "kvtransfer":
        from tandem.bench.kvtransfer_bench import run_kvtransfer_bench

        if args.size_mib < 1:
            raise InvalidRequestError("--size-mib", f"must be at least 1, got {args.size_mib}")
        result = run_kvtransfer_bench(args.size_mib, args.repeats, args.address)
        emit(json.dumps(result, indent=None if args.json else 2))
        return 0
    if args.command == "bench" and args.bench_command == "soak":
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
    if args.command == "bench" and args.bench_command == "host":
        from tandem.bench.host_bench import run_host_command

        return run_host_command(args, emit)
    if args.command == "bench" and args.bench_command == "serve":
        from tandem.bench.serve_bench import run_serve_bench

        return run_serve_bench(args)
    if args.command == "bench" and args.bench_command == "compare":
        from tandem.bench.compare import run_compare_command

        return run_compare_command(args)
    if args.command == "bench" and args.bench_command == "tiers":
        from tandem.bench.tier_bench import run_tiers_command

        return run_tiers_command(args)
    if args.command == "bench" and args.bench_command == "start":
        from tandem.bench.start_bench import run_start_command

        return run_start_command(args)
    if args.command == "bench" and args.bench_command == "speculative":
        from tandem.bench.spec_bench import run_speculative_command

        return run_speculative_command(args)
    if args.command == "bench" and args.bench_command == "router":
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
    if args.command == "bench" and args.bench_command == "trace":
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
    if args.command == "bench" and args.bench_command == "dep":
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
    if args.command == "bench":
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
    raise CliError(f"unknown command {args.command}")


def _generate(args: argparse.Namespace) -> int:
    from tandem.client.prompts import parse_prompt_ids, read_prompts_file
    from tandem.engine.colocated import ColocatedEngine
    from tandem.model.dtypes import DTYPES

    base = _sampling(args)
    if args.prompts_file is not None:
        specs = read_prompts_file(args.prompts_file, base)
    elif args.prompt_ids is not None:
        specs = [PromptSpec(None, parse_prompt_ids(args.prompt_ids), base)]
    else:
        if not args.prompt:
            raise InvalidRequestError("--prompt", "is empty")
        specs = [PromptSpec(args.prompt, None, base)]
    engine_config = EngineConfig(page_size=args.page_size, num_pages=args.num_pages)
    modes = [m for m in ("dep", "preset", "topology") if getattr(args, m) is not None]
    if len(modes) > 1:
        raise InvalidRequestError(f"--{modes[1]}", f"cannot be combined with --{modes[0]}")
    if args.preset is not None or args.topology is not None:
        return _generate_disaggregated(args, specs, engine_config)
    for flag in ("speculative_tokens", "drafter"):
        if getattr(args, flag) is not None:
            name = f"--{flag.replace('_', '-')}"
            raise InvalidRequestError(name, "runs on decode ranks: give --preset or --topology")
    for flag in ("host_cache_pages", "device_cache_pages", "kv_store", "kv_store_secret_file"):
        if getattr(args, flag) is not None:
            name = f"--{flag.replace('_', '-')}"
            raise InvalidRequestError(
                name, "KV tiers serve a deployment's ranks: give --preset or --topology"
            )
    if args.dep is not None:
        return _generate_dep(args, specs, engine_config)
    engine = ColocatedEngine.from_model_dir(args.model, DTYPES[args.dtype], engine_config)
    prompts = _encode(specs, engine.tokenizer)
    outputs = engine.generate(prompts, [s.sampling for s in specs])
    # the engine in this process has one tier: every cached token is on its device pages
    rows = [
        Output(
            o.token_ids,
            o.text,
            o.prompt_tokens,
            o.cached_tokens,
            CachedByTier(o.cached_tokens),
            o.finish_reason,
        )
        for o in outputs
    ]
    _print_outputs(args.json, rows)
    return 0


def _encode(specs: list[PromptSpec], tokenizer: Tokenizer | None) -> list[list[int]]:
    prompts: list[list[int]] = []
    for spec in specs:
        if spec.token_ids is not None:
            prompts.append(spec.token_ids)
        else:
            assert tokenizer is not None and spec.text is not None
            prompts.append(tokenizer.encode(spec.text))
    return prompts


class Output(NamedTuple):
    """One output as ``generate`` prints it; ``--json`` prints each as an object of these fields."""

    token_ids: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int
    cached_tokens_by_tier: CachedByTier
    finish_reason: str

    def record(self) -> dict[str, object]:
        return self._asdict() | {"cached_tokens_by_tier": self.cached_tokens_by_tier.as_dict()}


def _print_outputs(as_json: bool, outputs: Sequence[Output]) -> None:
    if as_json:
        emit(json.dumps({"outputs": [o.record() for o in outputs]}))
    else:
        for o in outputs:
            emit(o.text)


def _generate_disaggregated(
    args: argparse.Namespace, specs: list[PromptSpec], engine_config: EngineConfig
) -> int:
    from tandem.cli.generate import generate_on_cluster, summary_record
    from tandem.cli.serving import check_drafter_model, with_speculative, with_tiers
    from tandem.cluster.topology import Topology
    from tandem.model.checkpoint import check_model_dir
    from tandem.model.tokenizer import Tokenizer
    from tandem.wire.request_params import check_prompt

    topology = Topology.preset(args.preset) if args.preset is not None else Topology.load(args.topology)
    topology = with_tiers(args, with_speculative(args, topology))
    cfg = check_model_dir(args.model)
    check_drafter_model(topology, args.model)  # tensors included: no rank is the first to find a bad file
    tokenizer = Tokenizer.from_dir(args.model)
    prompts = _encode(specs, tokenizer)
    for prompt in prompts:  # rejected here, before any actor starts
        check_prompt(prompt, cfg.vocab_size, engine_config.context_len(cfg))
    summaries = generate_on_cluster(
        topology, str(args.model), prompts, [s.sampling for s in specs], args.dtype, args.address
    )
    errors = [s.error for s in summaries if s.error]
    if errors:
        raise CliError(errors[0])
    rows = [
        Output(
            s.token_ids,
            s.text,
            s.bill.prompt_tokens,
            s.bill.cached_tokens,
            s.bill.cached_tokens_by_tier,
            s.finish_reason,
        )
        for s in summaries
    ]
    if args.json:
        outputs = [row.record() | summary_record(s) for row, s in zip(rows, summaries, strict=True)]
        emit(json.dumps({"outputs": outputs}))
    else:
        _print_outputs(False, rows)
    return 0


def _generate_dep(args: argparse.Namespace, specs: list[PromptSpec], engine_config: EngineConfig) -> int:
    from tandem.cli.generate import generate_on_dep_group
    from tandem.model.checkpoint import check_model_dir
    from tandem.model.tokenizer import Tokenizer
    from tandem.wire.request_params import check_prompt

    if args.dep < 1:
        raise InvalidRequestError("--dep", f"must be at least 1, got {args.dep}")
    cfg = check_model_dir(args.model)  # tensors included: no rank is the first to find a bad file
    tokenizer = Tokenizer.from_dir(args.model)
    prompts = _encode(specs, tokenizer)
    # validate here, before any actor starts: the same checks every rank makes
    for prompt in prompts:
        check_prompt(prompt, cfg.vocab_size, engine_config.context_len(cfg))
    results = generate_on_dep_group(
        args.model, prompts, [s.sampling for s in specs], args.dep, args.dtype, engine_config, args.address
    )
    errors = [r.error for r in results if r.error]
    if errors:
        raise CliError(errors[0])
    _print_outputs(
        args.json,
        [
            Output(
                list(r.token_ids),
                tokenizer.decode(list(r.token_ids)),
                r.bill.prompt_tokens,
                r.bill.cached_tokens,
                r.bill.cached_tokens_by_tier,
                r.finish_reason,
            )
            for r in results
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
