"""The ``tandem`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from tandem.cli.errors import CliError
from tandem.client.output import command_output, emit
from tandem.client.prompts import PromptSpec
from tandem.engine.engine_config import EngineConfig
from tandem.wire.messages import CachedByTier
from tandem.wire.request_params import Guide, GuideKind, InvalidRequestError, SamplingParams

if TYPE_CHECKING:
    from tandem.model.tokenizer import Tokenizer


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


def _add_model_commands(sub: Any) -> None:
    """``tandem model``'s subcommands: make-tiny, fp4-experts, train-demo."""
    model = sub.add_parser("model", help="model utilities").add_subparsers(
        dest="model_command", required=True
    )
    tiny = model.add_parser("make-tiny", help="write a tiny random DeepSeek checkpoint (V3, or V4)")
    tiny.add_argument("dir", type=Path)
    tiny.add_argument("--seed", type=int, default=0)
    tiny.add_argument(
        "--arch",
        choices=["deepseek_v3", "deepseek_v4"],
        default="deepseek_v3",
        help="the architecture (deepseek_v4: every layer type, hash and scored MoE)",
    )
    tiny.add_argument("--mtp", action="store_true", help="add a (random) multi-token-prediction layer")
    tiny.add_argument(
        "--fp8-block",
        type=int,
        default=None,
        metavar="B",
        help="write it in DeepSeek's FP8 format (V3's or V4's) with B x B block scales (releases use 128)",
    )
    fp4 = model.add_parser(
        "fp4-experts",
        help="rewrite a DeepSeek-V4 checkpoint's routed experts in FP4, the format V4 ships them in",
    )
    fp4.add_argument("src", type=Path, metavar="SRC", help="a V4 checkpoint (unquantised or FP8)")
    fp4.add_argument("dst", type=Path, metavar="DST", help="where the FP4 checkpoint goes (must not exist)")
    fp4.add_argument(
        "--twin",
        type=Path,
        default=None,
        metavar="DIR",
        help="also write its dequantised twin here: SRC with the experts the FP4 values dequantised",
    )
    demo = model.add_parser("train-demo", help="train the tiny model on English text (the default model)")
    demo.add_argument("dir", type=Path, help="where to write the checkpoint (the committed one: model/demo)")
    demo.add_argument("--corpus", type=Path, default=None, help="UTF-8 text (default: model/demo/corpus.txt)")
    demo.add_argument("--steps", type=int, default=None, help="optimizer steps (default 1400)")
    demo.add_argument("--seed", type=int, default=0, help="initialisation and batch order")
    demo.add_argument(
        "--arch",
        choices=("deepseek_v3", "deepseek_v4"),
        default="deepseek_v3",
        help="the tiny model trained (deepseek_v4: model/train_demo_v4.py)",
    )
    demo.add_argument(
        "--mtp-steps", type=int, default=None, help="MTP layer steps after (default 600; 0: none)"
    )
    demo.add_argument(
        "--mtp-only",
        action="store_true",
        help="train only the MTP layer of the checkpoint already in DIR (its model's weights kept)",
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Disaggregated DeepSeek-V3 serving on Ray")
    sub = parser.add_subparsers(dest="command", required=True)

    _add_model_commands(sub)

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
    from tandem.cli.serving_parsers import add_rank_arguments, add_serving_parsers

    add_rank_arguments(gen)

    add_serving_parsers(sub, _sampling_args)
    from tandem.cli.deployment import add_deployment_parsers

    add_deployment_parsers(sub)
    from tandem.cli.plan import add_plan_parsers

    add_plan_parsers(sub)

    from tandem.cli.bench_commands import add_bench_parsers

    add_bench_parsers(sub)
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
    full, mtp_only, what = td.train_demo, td.train_demo_mtp, "the demo checkpoint"
    if args.arch == "deepseek_v4":
        from tandem.model.train_demo_v4 import train_demo_v4, train_demo_v4_mtp

        full, mtp_only, what = train_demo_v4, train_demo_v4_mtp, "the DeepSeek-V4 demo checkpoint"
    try:
        result = (mtp_only if args.mtp_only else full)(args.dir, corpus, settings, log=log)
    except td.TrainingDependencyMissing as exc:
        raise CliError(str(exc)) from exc
    if settings.mtp_steps:
        emit(
            f"MTP layer: {settings.mtp_steps} steps in {result.mtp_wall_s:.0f} s, held-out next-next-byte "
            f"loss {result.mtp_eval_bits:.2f} bits per character"
        )
    if args.mtp_only:
        emit(f"wrote {what} to {result.out_dir}, its model's weights as they were")
        return 0
    emit(
        f"wrote {what} to {result.out_dir}: {settings.steps} steps in {result.wall_s:.0f} s, "
        f"held-out loss {result.initial_eval_bits:.2f} -> {result.eval_bits:.2f} bits per character"
    )
    return 0


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "model" and args.model_command == "train-demo":
        return _train_demo(args)
    if args.command == "model" and args.model_command == "fp4-experts":
        from tandem.model.v4.fp4_experts import write_fp4_experts

        try:
            write_fp4_experts(args.src, args.dst, args.twin)
        except ValueError as exc:
            flag, why = str(exc).split(": ", 1)
            raise InvalidRequestError(flag, why) from None
        emit(f"wrote {args.dst}" + (f" and its dequantised twin {args.twin}" if args.twin else ""))
        return 0
    if args.command == "model":
        from tandem.model.make_tiny import make_tiny_checkpoint

        extra = {"num_nextn_predict_layers": 1} if args.mtp else {}
        block = (args.fp8_block, args.fp8_block) if args.fp8_block else None
        try:
            path = make_tiny_checkpoint(args.dir, seed=args.seed, fp8_block=block, arch=args.arch, **extra)
        except ValueError as exc:
            flag, why = str(exc).split(": ", 1)
            raise InvalidRequestError(flag, why) from None
        version = "V4" if args.arch == "deepseek_v4" else "V3"
        emit(f"wrote tiny DeepSeek-{version} checkpoint to {path}")
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
    if args.command == "bench":
        from tandem.cli.bench_commands import run_bench

        return run_bench(args)
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
    from tandem.cli.serving import prefill_chunk_tokens

    chunk = prefill_chunk_tokens(args)
    engine_config = EngineConfig(
        page_size=args.page_size, num_pages=args.num_pages, prefill_chunk_tokens=chunk
    )
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
    from tandem.cli.serving import (
        check_deployment_model,
        check_drafter_model,
        fit_v4_deployment,
        with_prefill_chunk,
        with_speculative,
        with_tiers,
    )
    from tandem.cluster.topology import Topology
    from tandem.model.family import read_config
    from tandem.model.tokenizer import Tokenizer
    from tandem.wire.request_params import check_prompt

    topology = Topology.preset(args.preset) if args.preset is not None else Topology.load(args.topology)
    topology = with_prefill_chunk(args, with_tiers(args, with_speculative(args, topology)))
    topology = fit_v4_deployment(topology, args.model)
    check_deployment_model(args.model)
    cfg = read_config(args.model)
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
    from tandem.model.loader import check_any_model_dir
    from tandem.model.tokenizer import Tokenizer
    from tandem.wire.request_params import check_prompt

    if args.dep < 1:
        raise InvalidRequestError("--dep", f"must be at least 1, got {args.dep}")
    cfg = check_any_model_dir(args.model)  # tensors included: no rank is the first to find a bad file
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
