"""``tandem bench host``: what the host path costs, three parts measured side by side in one run.

    decode     a gRPC client's inter-token latency on one-rank groups over the bare forward of
               the same model at the same batch, and the decode rank's step split
               (``bench/host_decode.py``)
    frontend   streamed tokens per second per core of the frontend, fed by ranks that produce
               tokens without a model (``bench/host_frontend.py``)
    transfer   NIXL GB/s over memcpy GB/s of the same bytes, whole-request and layer-wise, with
               the UCX transports selected (``bench/kvtransfer_bench.py``)

Each part starts its own Ray and stops it. ``--json`` carries every part's figures and, at its
top, ``decode_itl_over_forward`` (concurrency 1), ``frontend_tokens_per_s_per_core`` (256 streams,
the first workload of ``--workload``: realistic, easy or both) and ``nixl_over_memcpy``
(whole-request).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.wire.request_params import InvalidRequestError

PARTS = ("decode", "frontend", "transfer")
HEADLINES = {
    "decode": "decode_itl_over_forward",
    "frontend": "frontend_tokens_per_s_per_core",
    "transfer": "nixl_over_memcpy",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--concurrency", default="1,8", help="decode: client concurrencies")
    parser.add_argument("--output-tokens", type=int, default=256, help="decode: tokens per request")
    parser.add_argument("--streams", default="64,256", help="frontend: concurrent streams")
    parser.add_argument(
        "--stream-interval", type=int, default=1, help="frontend: tokens a stream's message waits for"
    )
    parser.add_argument(
        "--workload",
        default="realistic",
        help="frontend: realistic (a 100k-id tokenizer, 1-4k-token prompts with shared prefixes, KV "
        "events, a passage of real text per stream), easy (the demo tokenizer, one short prompt and "
        "one cyclic stream), or both side by side",
    )
    parser.add_argument("--size-mib", type=int, default=256, help="transfer: bytes of one request's KV")
    parser.add_argument("--repeats", type=int, default=3, help="runs (decode: rounds) per figure (median)")
    parser.add_argument(
        "--no-pin",
        dest="pin",
        action="store_false",
        help="decode: leave the ranks, the frontend and the client on any core",
    )
    parser.add_argument("--json", action="store_true")


def _counts(flag: str, text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        raise InvalidRequestError(flag, f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise InvalidRequestError(flag, f"expected integers of at least 1, got {text!r}")
    return values


def check_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The parts to run, every flag checked before anything starts; an error names the flag."""
    parts = tuple(p.strip() for p in args.parts.split(",") if p.strip())
    unknown = [p for p in parts if p not in PARTS]
    if not parts or unknown:
        raise InvalidRequestError("--parts", f"expected some of {', '.join(PARTS)}, got {args.parts!r}")
    _counts("--concurrency", args.concurrency)
    streams = _counts("--streams", args.streams)
    if "frontend" in parts and 256 not in streams:
        raise InvalidRequestError("--streams", "must include 256 (the headline figure's)")
    if "frontend" in parts:
        from tandem.bench.frontend_workload import WORKLOADS  # here: it loads the tokenizer library

        if args.workload not in (*WORKLOADS, "both"):
            raise InvalidRequestError(
                "--workload", f"expected one of {', '.join(WORKLOADS)} or both, got {args.workload!r}"
            )
    for flag in ("output_tokens", "size_mib", "repeats", "stream_interval"):
        if getattr(args, flag) < 1:
            raise InvalidRequestError(
                f"--{flag.replace('_', '-')}", f"must be at least 1, got {getattr(args, flag)}"
            )
    if args.model is not None:
        from tandem.model.checkpoint import check_model_dir

        try:
            check_model_dir(args.model)
        except ValueError as exc:  # the checkpoint's errors name the file
            raise InvalidRequestError("--model", str(exc)) from None
    return parts


def _runners(args: argparse.Namespace) -> dict[str, Callable[[], dict[str, Any]]]:
    def decode() -> dict[str, Any]:
        from tandem.bench.host_decode import DecodeOptions, measure_decode

        options = DecodeOptions(
            concurrency=_counts("--concurrency", args.concurrency),
            output_tokens=args.output_tokens,
            rounds=args.repeats,
            model_dir=args.model,
            pin=args.pin,
        )
        return measure_decode(options)

    def frontend() -> dict[str, Any]:
        from tandem.bench.host_frontend import measure_frontend

        return measure_frontend(
            streams=_counts("--streams", args.streams),
            repeats=args.repeats,
            stream_interval=args.stream_interval,
            workload=args.workload,
        )

    def transfer() -> dict[str, Any]:
        from tandem.bench.kvtransfer_bench import measure_transfer

        return measure_transfer(args.size_mib, args.repeats)

    return {"decode": decode, "frontend": frontend, "transfer": transfer}


def run_host_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--json`` object: the headline figures, then each part's own."""
    parts = check_args(args)
    runners = _runners(args)
    results = {part: runners[part]() for part in parts}
    headline = {HEADLINES[p]: results[p].get(HEADLINES[p]) for p in parts}
    return {**headline, **results}


def format_host(result: dict[str, Any]) -> str:
    lines = ["tandem bench host"]
    for key in HEADLINES.values():
        if key in result:
            lines.append(f"  {key:<34} {result[key]}")
    decode = result.get("decode")
    if decode:
        lines.append("  decode step (ms, the decode rank's mean step):")
        for point in decode["points"]:
            split = ", ".join(
                f"{k.removesuffix('_ms')} {v}"
                for k, v in point["decode_step"].items()
                if k not in ("steps", "loop_over_forward")
            )
            split += f"; the rank's loop over its forward {point['decode_step'].get('loop_over_forward')}x"
            lines.append(
                f"    C={point['concurrency']}: ITL P50 {point['itl_p50_ms']} ms, bare forward "
                f"{point['bare_forward_ms']} ms ({point['itl_over_forward']}x); {split}"
            )
    side = (result.get("frontend") or {}).get("side_by_side")
    if side:
        for workload, figures in side.items():
            at = ", ".join(f"{n} streams {v}" for n, v in figures.items())
            lines.append(f"  frontend tokens/s/core, {workload}: {at}")
    for part in ("frontend", "transfer"):
        if part in result:
            lines.append(f"  {part}: {json.dumps(result[part])}")
    return "\n".join(lines)


def run_host_command(args: argparse.Namespace, emit: Callable[[str], None] = print) -> int:
    result = run_host_bench(args)
    emit(json.dumps(result) if args.json else format_host(result))
    return 0
