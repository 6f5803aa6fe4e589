"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from cluster.prompts import PromptSpec
from engine.colocated import EngineConfig
from engine.request import InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from model.tokenizer import Tokenizer


class CliError(Exception):
    """A problem the user can fix; printed as one line, exit code 2."""


def _sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, required=True, help="tokens to generate per prompt")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0, help="0 disables top-k")
    parser.add_argument("--seed", type=int, default=None, help="per-request seed for sampling")
    parser.add_argument("--ignore-eos", action="store_true", help="do not stop at the end-of-sequence token")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated DeepSeek-V3 serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    model = sub.add_parser("model", help="model utilities").add_subparsers(
        dest="model_command", required=True
    )
    tiny = model.add_parser("make-tiny", help="write a tiny random DeepSeek-V3 checkpoint")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--seed", type=int, default=0)

    gen = sub.add_parser("generate", help="generate with the colocated engine")
    gen.add_argument("--model", type=Path, required=True, help="Hugging Face model directory")
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

    srv = sub.add_parser("serve", help="start the cluster and the gRPC frontend; Ctrl-C stops")
    srv.add_argument("--preset", default=None, help="topology preset of deploy/presets (default: local)")
    srv.add_argument("--topology", type=Path, default=None, help="topology file (instead of --preset)")
    srv.add_argument("--model", type=Path, default=None, help="model directory (default: the tiny model)")
    srv.add_argument("--model-name", default=None, help="name clients give (default: the directory's)")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0: every interface)")
    srv.add_argument("--port", type=int, default=50051, help="0 picks a free port")
    srv.add_argument("--dtype", choices=["float32", "bfloat16", "float16", "float64"], default="float32")
    srv.add_argument("--address", default=None, help="Ray cluster to join (default: start Ray here)")
    srv.add_argument("--max-running-requests", type=int, default=256, help="beyond: RESOURCE_EXHAUSTED")
    srv.add_argument("--auth-token-file", type=Path, default=None, help="require this bearer token")
    srv.add_argument("--tls-cert", default=None, help="PEM certificate: serve TLS")
    srv.add_argument("--tls-key", default=None, help="PEM private key of --tls-cert")

    client = sub.add_parser("client", help="talk to a running `tandem serve`").add_subparsers(
        dest="client_command", required=True
    )
    cgen = client.add_parser("generate", help="generate over gRPC")
    csrc = cgen.add_mutually_exclusive_group(required=True)
    csrc.add_argument("text", nargs="?", default=None, help="prompt text")
    csrc.add_argument("--prompts-file", type=Path, help="JSONL, one prompt object a line")
    _sampling_args(cgen)
    cgen.add_argument("--stream", action="store_true", help="print text as it arrives")
    cgen.add_argument("--concurrency", type=int, default=1, help="streams open at once")
    cgen.add_argument("--json", action="store_true", help="print one JSON object")
    cstat = client.add_parser("status", help="groups, ranks, loads and free pages")
    cstat.add_argument("--check-integrity", action="store_true")
    chealth = client.add_parser("health", help="exit 0 once the server is SERVING")
    chealth.add_argument("--wait", type=float, default=0.0, help="seconds to keep asking")
    for c in (cgen, cstat, chealth):
        c.add_argument("--addr", default="127.0.0.1:50051", help="HOST:PORT of the frontend")
        c.add_argument("--token-file", type=Path, default=None, help="bearer token to send")
        c.add_argument("--tls-ca", default=None, help="PEM of the CA to trust: use TLS")
        c.add_argument("--timeout", type=float, default=None, help="deadline of each call, seconds")

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
    kv = bench.add_parser("kvtransfer", help="NIXL transfer speed between two actors against memcpy")
    kv.add_argument("--size-mib", type=int, default=256)
    kv.add_argument("--repeats", type=int, default=3)
    kv.add_argument("--address", default=None, help="Ray cluster to join (default: start Ray here)")
    kv.add_argument("--json", action="store_true")
    rb = bench.add_parser("router", help="Mooncake trace through the router over simulated prefill ranks")
    rb.add_argument("--trace", type=Path, required=True, help="Mooncake-format JSONL trace")
    rb.add_argument("--prefill-ranks", type=int, default=8)
    rb.add_argument("--capacity-blocks", type=int, default=None, help="per-rank cache, 512-token blocks")
    rb.add_argument("--prefill-tokens-per-s", type=float, default=None, help="uncached tokens/s per rank")
    rb.add_argument("--policy", default=None, help="prefill policy (default cache_aware)")
    rb.add_argument("--json", action="store_true")
    return parser


def main(argv: list[str] | None = None) -> int:
    from cluster.topology import TopologyError
    from model.checkpoint import CheckpointError
    from model.config import ModelConfigError
    from model.kernels.backend import UnknownKernelBackend
    from model.make_tiny import TinyCheckpointError
    from model.tokenizer import TokenizerError

    args = build_parser().parse_args(argv)
    try:
        return _dispatch(args)
    except (
        TopologyError,
        CliError,
        InvalidRequestError,
        ModelConfigError,
        CheckpointError,
        TokenizerError,
        TinyCheckpointError,
        UnknownKernelBackend,
    ) as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 2


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "model":
        from model.make_tiny import make_tiny_checkpoint

        path = make_tiny_checkpoint(args.dir, seed=args.seed)
        print(f"wrote tiny DeepSeek-V3 checkpoint to {path}")
        return 0
    if args.command == "generate":
        return _generate(args)
    if args.command == "serve":
        return _serve(args)
    if args.command == "client":
        return _client(args)
    if args.command == "bench" and args.bench_command == "disagg":
        from bench.disagg_bench import run_disagg_bench

        result = run_disagg_bench(
            args.model,
            args.preset,
            [int(c) for c in args.concurrency.split(",")],
            args.requests,
            args.prompt_tokens,
            args.output_tokens,
            address=args.address,
        )
        print(json.dumps(result, indent=None if args.json else 2))
        return 0
    if args.command == "bench" and args.bench_command == "kvtransfer":
        from bench.kvtransfer_bench import run_kvtransfer_bench

        if args.size_mib < 1:
            raise InvalidRequestError("--size-mib", f"must be at least 1, got {args.size_mib}")
        result = run_kvtransfer_bench(args.size_mib, args.repeats, args.address)
        print(json.dumps(result, indent=None if args.json else 2))
        return 0
    if args.command == "bench" and args.bench_command == "router":
        from bench import router_bench

        options = {
            "capacity_blocks": args.capacity_blocks,
            "prefill_tokens_per_s": args.prefill_tokens_per_s,
            "policy": args.policy,
        }
        try:
            result = router_bench.run_router_bench(
                args.trace, args.prefill_ranks, **{k: v for k, v in options.items() if v is not None}
            )
        except ValueError as exc:  # TraceError, a bad option or an unknown policy
            raise CliError(str(exc)) from exc
        print(json.dumps(result) if args.json else router_bench.format_report(result))
        return 0
    if args.command == "bench" and args.bench_command == "dep":
        from bench.dep_bench import run_dep_bench

        result = run_dep_bench(
            args.model,
            [int(n) for n in args.sizes.split(",")],
            args.requests_per_rank,
            args.prompt_tokens,
            args.output_tokens,
            args.dtype,
            args.address,
        )
        print(json.dumps(result, indent=None if args.json else 2))
        return 0
    if args.command == "bench":
        from bench.engine_bench import run_engine_bench

        result = run_engine_bench(
            args.model,
            dtype=args.dtype,
            prompt_tokens=args.prompt_tokens,
            output_tokens=args.output_tokens,
            batch_sizes=[int(b) for b in args.batch_sizes.split(",")],
            temperature=args.temperature,
        )
        print(json.dumps(result, indent=None if args.json else 2))
        return 0
    raise CliError(f"unknown command {args.command}")


def _generate(args: argparse.Namespace) -> int:
    from cluster.prompts import parse_prompt_ids, read_prompts_file
    from engine.colocated import DTYPES, ColocatedEngine

    base = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
    )
    base.validate()
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
    if args.dep is not None:
        return _generate_dep(args, specs, engine_config)
    engine = ColocatedEngine.from_model_dir(args.model, DTYPES[args.dtype], engine_config)
    prompts = _encode(specs, engine.tokenizer)
    outputs = engine.generate(prompts, [s.sampling for s in specs])
    _print_outputs(
        args.json, [(o.token_ids, o.text, o.prompt_tokens, o.cached_tokens, o.finish_reason) for o in outputs]
    )
    return 0


def _read_secret(path: Path | None, flag: str) -> str | None:
    if path is None:
        return None
    try:
        secret = path.read_text().strip()
    except OSError as exc:
        raise CliError(f"{flag}: cannot read {path}: {exc.strerror}") from None
    if not secret:
        raise CliError(f"{flag}: {path} is empty")
    return secret


def _serve(args: argparse.Namespace) -> int:
    from cluster.serve import ServeOptions, serve
    from cluster.topology import Topology

    if args.preset is not None and args.topology is not None:
        raise InvalidRequestError("--topology", "cannot be combined with --preset")
    topology = Topology.load(args.topology) if args.topology else Topology.preset(args.preset or "local")
    if args.model is not None and not (args.model / "config.json").is_file():
        raise CliError(f"--model: {args.model} holds no config.json")
    if not 0 <= args.port < 65536:
        raise InvalidRequestError("--port", f"must be in [0, 65535], got {args.port}")
    if args.max_running_requests < 1:
        raise InvalidRequestError("--max-running-requests", "must be at least 1")
    if bool(args.tls_cert) != bool(args.tls_key):
        raise InvalidRequestError(
            "--tls-key" if args.tls_cert else "--tls-cert", "--tls-cert and --tls-key go together"
        )
    options = ServeOptions(
        topology=topology,
        model_dir=args.model,
        host=args.host,
        port=args.port,
        dtype=args.dtype,
        address=args.address,
        model_name=args.model_name,
        auth_token=_read_secret(args.auth_token_file, "--auth-token-file"),
        tls_cert_file=args.tls_cert,
        tls_key_file=args.tls_key,
        max_running_requests=args.max_running_requests,
    )
    return serve(options)


def _client(args: argparse.Namespace) -> int:
    import asyncio

    import grpc

    from cluster.client import ClientOptions, run_generate, status, wait_serving
    from cluster.prompts import read_prompts_file

    options = ClientOptions(
        args.addr, _read_secret(args.token_file, "--token-file"), args.tls_ca, timeout_s=args.timeout
    )
    try:
        if args.client_command == "health":
            ok = asyncio.run(wait_serving(options, args.wait))
            print("SERVING" if ok else "NOT_SERVING")
            return 0 if ok else 1
        if args.client_command == "status":
            from cluster.client import message_dict

            reply = asyncio.run(status(options, args.check_integrity))
            print(json.dumps(message_dict(reply), indent=2))
            return 0
        base = SamplingParams(
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            top_k=args.top_k,
            seed=args.seed,
            ignore_eos=args.ignore_eos,
        )
        base.validate()
        if args.concurrency < 1:
            raise InvalidRequestError("--concurrency", f"must be at least 1, got {args.concurrency}")
        if args.prompts_file is not None:
            specs = read_prompts_file(args.prompts_file, base)
        else:
            if not args.text:
                raise InvalidRequestError("text", "is empty")
            specs = [PromptSpec(args.text, None, base)]
        return run_generate(options, specs, args.concurrency, args.stream, args.json)
    except grpc.aio.AioRpcError as exc:
        print(f"tandem: error: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 1


def _encode(specs: list[PromptSpec], tokenizer: Tokenizer | None) -> list[list[int]]:
    prompts: list[list[int]] = []
    for spec in specs:
        if spec.token_ids is not None:
            prompts.append(spec.token_ids)
        else:
            assert tokenizer is not None and spec.text is not None
            prompts.append(tokenizer.encode(spec.text))
    return prompts


def _print_outputs(as_json: bool, outputs: list[tuple[list[int], str, int, int, str]]) -> None:
    if as_json:
        keys = ("token_ids", "text", "prompt_tokens", "cached_tokens", "finish_reason")
        print(json.dumps({"outputs": [dict(zip(keys, o, strict=True)) for o in outputs]}))
    else:
        for o in outputs:
            print(o[1])


def _generate_disaggregated(
    args: argparse.Namespace, specs: list[PromptSpec], engine_config: EngineConfig
) -> int:
    from cluster.disagg_generate import generate_on_cluster, result_record
    from cluster.topology import Topology
    from engine.request import check_prompt
    from model.config import ModelConfig
    from model.tokenizer import Tokenizer

    topology = Topology.preset(args.preset) if args.preset is not None else Topology.load(args.topology)
    cfg = ModelConfig.from_dir(args.model)
    tokenizer = Tokenizer.from_dir(args.model)
    prompts = _encode(specs, tokenizer)
    for prompt in prompts:  # rejected here, before any actor starts
        check_prompt(prompt, cfg.vocab_size, engine_config.context_len(cfg))
    results = generate_on_cluster(
        topology, str(args.model), prompts, [s.sampling for s in specs], args.dtype, args.address
    )
    errors = [r.error for r in results if r.error]
    if errors:
        raise CliError(errors[0])
    rows = [
        (
            r.token_ids,
            tokenizer.decode(r.token_ids),
            r.bill.prompt_tokens,
            r.bill.cached_tokens,
            r.finish_reason,
        )
        for r in results
    ]
    if args.json:
        keys = ("token_ids", "text", "prompt_tokens", "cached_tokens", "finish_reason")
        outputs = [
            dict(zip(keys, row, strict=True)) | result_record(r) for row, r in zip(rows, results, strict=True)
        ]
        print(json.dumps({"outputs": outputs}))
    else:
        _print_outputs(False, rows)
    return 0


def _generate_dep(args: argparse.Namespace, specs: list[PromptSpec], engine_config: EngineConfig) -> int:
    from cluster.dep_generate import generate_on_dep_group
    from engine.request import check_prompt
    from model.config import ModelConfig
    from model.tokenizer import Tokenizer

    if args.dep < 1:
        raise InvalidRequestError("--dep", f"must be at least 1, got {args.dep}")
    cfg = ModelConfig.from_dir(args.model)
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
            (r.token_ids, tokenizer.decode(r.token_ids), r.prompt_tokens, r.cached_tokens, r.finish_reason)
            for r in results
        ],
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
