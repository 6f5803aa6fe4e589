"""``tandem bench serve``: a running deployment benchmarked through its gRPC port (no Ray, no
torch), reported from what the client measured and from each request's bill.

Two workloads (``bench/serve_workload.py``):

* a concurrency sweep (``--concurrency 1,2,4,8``), closed loop: at each point C users each send a
  request, wait for its summary and send the next, ``--requests-per-point`` in all (or for
  ``--duration`` seconds); synthetic prompts with ``--prefixes`` shared prefixes;
* a Mooncake trace replay (``--trace``), open loop: each request goes out at its timestamp times
  ``--time-scale`` whatever the others do.

Every request asks for ``ignore_eos`` and a fixed ``max_tokens``, so output lengths are those
asked for. The figures of each point are ``bench/serve_stats.py``'s; the deployment's rank counts
come from ``ClusterStatus`` before the first point.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import grpc

from tandem.bench.router_bench import TraceError, read_trace
from tandem.bench.serve_price import DEFAULT_CACHED_WEIGHT, point_prices
from tandem.bench.serve_stats import Pools, RequestRecord, point_stats
from tandem.bench.serve_workload import BenchRequest, SyntheticWorkload, TextWorkload, TraceReplay
from tandem.client.grpc_client import ClientOptions, channel, message_dict, metadata, request_message
from tandem.client.output import emit
from tandem.client.prompts import PromptSpec, read_prompts_file
from tandem.protos import tandem_pb2, tandem_pb2_grpc
from tandem.wire.messages import CachedByTier
from tandem.wire.request_params import InvalidRequestError, SamplingParams

TINY_VOCAB_SIZE = 256  # the tiny model's byte tokens (its two special tokens above them)
TINY_CONTEXT_TOKENS = 2048
STATUS_TIMEOUT_S = 10.0


class DeploymentUnreachable(Exception):
    """No answer to ``ClusterStatus`` at the address; the message says why, on one line."""


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``tandem bench serve``."""
    parser.add_argument("--addr", required=True, help="HOST:PORT of the deployment's frontend")
    auth = parser.add_mutually_exclusive_group()
    auth.add_argument("--token", default=None, help="bearer token to send")
    auth.add_argument("--token-file", type=Path, default=None, help="file holding the bearer token")
    parser.add_argument("--tls-ca", default=None, help="PEM of the CA to trust: use TLS")
    parser.add_argument("--timeout", type=float, default=None, help="deadline of each request, seconds")
    add_workload_arguments(parser)
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print one JSON object")
    out.add_argument("--markdown", action="store_true", help="print Markdown tables")
    parser.add_argument("--plot", type=Path, default=None, help="write the figures (PNG) to this folder")


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """What to send and the SLOs (``plan_from_args`` reads them): a sweep or a trace replay."""
    parser.add_argument(
        "--concurrency", default="1,2,4,8", help="closed-loop users per point, comma-separated"
    )
    parser.add_argument("--requests-per-point", type=int, default=32)
    parser.add_argument("--duration", type=float, default=None, help="seconds per point, instead of a count")
    parser.add_argument("--prompt-tokens", type=int, default=256)
    parser.add_argument("--output-tokens", type=int, default=32)
    parser.add_argument("--shared-prefix-tokens", type=int, default=128, help="of each prompt, shared")
    parser.add_argument("--prefixes", type=int, default=4, help="distinct shared prefixes")
    parser.add_argument("--trace", type=Path, default=None, help="Mooncake-format JSONL: replay it instead")
    parser.add_argument(
        "--prompts-file",
        type=Path,
        default=None,
        help='JSONL of {"prompt": text} lines: real text, not synthetic ids (--output-tokens each)',
    )
    parser.add_argument("--time-scale", type=float, default=1.0, help="send at timestamp x this")
    parser.add_argument("--block-tokens", type=int, default=512, help="tokens per trace hash block")
    parser.add_argument("--max-output-tokens", type=int, default=None, help="cap on a trace's outputs")
    parser.add_argument("--start", type=int, default=0, help="first trace request to send (arrival order)")
    parser.add_argument("--max-requests", type=int, default=None, help="trace requests to send")
    parser.add_argument("--context-tokens", type=int, default=TINY_CONTEXT_TOKENS, help="prompt + output cap")
    parser.add_argument("--vocab-size", type=int, default=TINY_VOCAB_SIZE, help="token ids are below it")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    parser.add_argument("--slo-itl-ms", type=float, default=200.0, help="on a request's mean ITL (TPOT)")
    parser.add_argument(
        "--gpu-hour-price", type=float, default=None,
        help="$ per GPU-hour (one rank a GPU): adds each point's price per million tokens",
    )  # fmt: skip
    parser.add_argument(
        "--cached-token-weight", type=float, default=DEFAULT_CACHED_WEIGHT,
        help="a cached prompt token's share of a new one's prefill cost, in [0, 1]",
    )  # fmt: skip


@dataclass(frozen=True)
class Plan:
    """What to send: a sweep (``synthetic`` and ``concurrency``) or a replay (``trace``)."""

    concurrency: tuple[int, ...] = ()
    synthetic: SyntheticWorkload | TextWorkload | None = None
    requests_per_point: int = 32
    duration_s: float | None = None
    trace: list[BenchRequest] | None = None
    slo_ttft_ms: float = 2000.0
    slo_itl_ms: float = 200.0


def plan_from_args(args: argparse.Namespace) -> Plan:
    """The plan of the command's options, checked; an error names the flag."""
    for flag in ("slo_ttft_ms", "slo_itl_ms"):
        if not getattr(args, flag) > 0:
            raise InvalidRequestError(
                f"--{flag.replace('_', '-')}", f"must be > 0, got {getattr(args, flag)}"
            )
    slo = {"slo_ttft_ms": args.slo_ttft_ms, "slo_itl_ms": args.slo_itl_ms}
    if args.trace is not None:
        return Plan(trace=_trace_requests(args), **slo)
    try:
        concurrency = tuple(int(c) for c in args.concurrency.split(","))
    except ValueError:
        raise InvalidRequestError(
            "--concurrency", f"expected comma-separated integers, got {args.concurrency!r}"
        ) from None
    if not concurrency or min(concurrency) < 1:
        raise InvalidRequestError("--concurrency", f"each must be at least 1, got {args.concurrency!r}")
    if args.requests_per_point < 1:
        raise InvalidRequestError(
            "--requests-per-point", f"must be at least 1, got {args.requests_per_point}"
        )
    if args.duration is not None and not args.duration > 0:
        raise InvalidRequestError("--duration", f"must be > 0 seconds, got {args.duration}")
    return Plan(concurrency, _workload(args), args.requests_per_point, args.duration, **slo)


def _checked(workload: TraceReplay | TextWorkload | SyntheticWorkload) -> None:
    """``workload.check()``, its error as the flag's."""
    try:
        workload.check()
    except ValueError as exc:
        flag, why = str(exc).split(": ", 1)
        raise InvalidRequestError(flag, why) from None


def _trace_requests(args: argparse.Namespace) -> list[BenchRequest]:
    """``--trace``'s requests from ``--start``, at most ``--max-requests`` of them."""
    replay = TraceReplay(
        args.block_tokens,
        args.time_scale,
        args.max_output_tokens,
        args.context_tokens,
        args.vocab_size,
        args.seed,
    )
    _checked(replay)
    if args.start < 0:
        raise InvalidRequestError("--start", f"must be at least 0, got {args.start}")
    if args.max_requests is not None and args.max_requests < 1:
        raise InvalidRequestError("--max-requests", f"must be at least 1, got {args.max_requests}")
    try:
        entries = read_trace(args.trace)
    except TraceError as exc:
        raise InvalidRequestError("--trace", str(exc)) from None
    end = None if args.max_requests is None else args.start + args.max_requests
    sliced = entries[args.start : end]
    if not sliced:
        raise InvalidRequestError("--start", f"{args.start} is past the trace's {len(entries)} requests")
    return replay.requests(sliced)


def _workload(args: argparse.Namespace) -> TextWorkload | SyntheticWorkload:
    """``--prompts-file``'s texts, or the synthetic prompts the options describe."""
    if args.prompts_file is not None:
        specs = read_prompts_file(args.prompts_file, SamplingParams())
        texts = tuple(s.text for s in specs if s.text is not None)
        if len(texts) != len(specs):
            raise InvalidRequestError(
                "--prompts-file", 'a text workload takes "prompt" lines, not prompt_ids'
            )
        workload = TextWorkload(texts, args.output_tokens)
        _checked(workload)
        return workload
    synthetic = SyntheticWorkload(
        args.prompt_tokens,
        args.output_tokens,
        args.shared_prefix_tokens,
        args.prefixes,
        args.vocab_size,
        args.seed,
    )
    _checked(synthetic)
    if args.prompt_tokens + args.output_tokens > args.context_tokens:
        raise InvalidRequestError(
            "--prompt-tokens",
            f"{args.prompt_tokens} + --output-tokens {args.output_tokens} pass --context-tokens "
            f"{args.context_tokens}",
        )
    return synthetic


class Progress:
    """A one-line progress bar on stderr, redrawn in place; silent when stderr is not a terminal."""

    WIDTH = 30

    def __init__(self, label: str, total: int | None, stream: TextIO | None = None) -> None:
        self.stream = stream or sys.stderr
        self.enabled = self.stream.isatty()
        self.label, self.total, self.done = label, total, 0
        self.start_s = time.perf_counter()
        self._draw()

    def advance(self) -> None:
        self.done += 1
        self._draw()

    def _draw(self) -> None:
        if not self.enabled:
            return
        elapsed = time.perf_counter() - self.start_s
        if self.total:
            filled = self.WIDTH * self.done // self.total
            bar = f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.done}/{self.total}"
        else:
            bar = f"{self.done} done"
        self.stream.write(f"\r{self.label} {bar} {elapsed:.0f}s")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


Send = Callable[[BenchRequest], Awaitable[RequestRecord]]


def _sender(stub: tandem_pb2_grpc.TandemStub, options: ClientOptions) -> Send:
    async def send(request: BenchRequest) -> RequestRecord:
        sampling = SamplingParams(max_tokens=request.max_tokens, ignore_eos=True)
        spec = PromptSpec(request.text, None if request.text is not None else request.prompt, sampling)
        message = request_message(spec)
        record = RequestRecord(sent_s=time.perf_counter())
        try:
            call = stub.Generate(message, metadata=metadata(options), timeout=options.timeout_s)
            async for response in call:
                now = time.perf_counter()
                if response.HasField("chunk"):
                    if response.chunk.token_ids:
                        record.chunks.append((now, len(response.chunk.token_ids)))
                else:
                    record.done_s = now
                    _read_summary(record, response.summary)
        except grpc.aio.AioRpcError as exc:
            record.error = f"{exc.code().name}: {exc.details()}"
        if record.error is None and (record.done_s is None or not record.chunks):
            record.error = "the stream ended without a summary" if record.done_s is None else "no token came"
        return record

    return send


def _read_summary(record: RequestRecord, summary: tandem_pb2.Summary) -> None:
    bill = summary.bill
    record.prompt_tokens = bill.prompt_tokens
    record.cached_tokens = bill.cached_tokens
    tiers = bill.cached_tokens_by_tier
    record.cached_tokens_by_tier = CachedByTier(tiers.device, tiers.host, tiers.store)
    record.new_prompt_tokens = bill.new_prompt_tokens
    record.output_tokens = bill.output_tokens
    record.latency_s = {k: float(v) for k, v in message_dict(bill.latency).items()}
    record.predicted_cached_tokens = summary.placement.predicted_cached_tokens
    record.prefill_rank = summary.placement.prefill_rank
    record.decode_rank = summary.placement.decode_rank
    spec = bill.speculation
    record.draft_tokens, record.accepted_tokens, record.decode_steps = (
        spec.draft_tokens,
        spec.accepted_tokens,
        spec.steps,
    )
    if summary.error or summary.finish_reason in ("error", "abort"):
        record.error = summary.error or f"finished with {summary.finish_reason}"


async def closed_loop(
    send: Send,
    workload: SyntheticWorkload | TextWorkload,
    concurrency: int,
    count: int,
    duration_s: float | None,
    point: int,
) -> tuple[list[RequestRecord], float]:
    """``concurrency`` users, each sending its next request once its last one ended; ``count``
    requests in all, or as many as start within ``duration_s``. Returns the records and the wall
    time."""
    records: list[RequestRecord] = []
    progress = Progress(f"C={concurrency}", None if duration_s is not None else count)
    next_index = 0
    start_s = time.perf_counter()

    async def user() -> None:
        nonlocal next_index
        while True:
            if duration_s is not None and time.perf_counter() - start_s >= duration_s:
                return
            if duration_s is None and next_index >= count:
                return
            index, next_index = next_index, next_index + 1
            records.append(await send(workload.request(point, index)))
            progress.advance()

    try:
        await asyncio.gather(*(user() for _ in range(concurrency)))
    finally:
        progress.close()
    return records, time.perf_counter() - start_s


async def open_loop(send: Send, requests: list[BenchRequest]) -> tuple[list[RequestRecord], float]:
    """Each request sent at its ``send_at_s`` from now, whatever the others do."""
    progress = Progress("trace", len(requests))
    start_s = time.perf_counter()

    async def at(request: BenchRequest) -> RequestRecord:
        delay = start_s + request.send_at_s - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        record = await send(request)
        progress.advance()
        return record

    try:
        records = list(await asyncio.gather(*(at(r) for r in requests)))
    finally:
        progress.close()
    return records, time.perf_counter() - start_s


def pools_of(reply: tandem_pb2.ClusterStatusResponse) -> Pools:
    """Ranks per pool of the groups that take work (every group's, if none is ready yet)."""
    ready = [g for g in reply.groups if g.state == "ready"] or list(reply.groups)
    roles = ("prefill", "decode", "colocated")
    count = {role: sum(len(g.ranks) for g in ready if g.role == role) for role in roles}
    return Pools(count["prefill"], count["decode"], count["colocated"])


async def run_plan(options: ClientOptions, plan: Plan) -> dict[str, Any]:
    """Ask the deployment its shape, then run every point; the ``--json`` object."""
    async with channel(options) as ch:
        stub = tandem_pb2_grpc.TandemStub(ch)
        try:
            reply = await stub.ClusterStatus(
                tandem_pb2.ClusterStatusRequest(), metadata=metadata(options), timeout=STATUS_TIMEOUT_S
            )
        except grpc.aio.AioRpcError as exc:
            why = (exc.details() or "").splitlines()[0] if exc.details() else ""
            raise DeploymentUnreachable(
                f"no Tandem deployment answers at {options.addr}: {exc.code().name}"
                + (f" ({why})" if why else "")
            ) from None
        pools = pools_of(reply)
        send = _sender(stub, options)
        points = []
        if plan.trace is not None:
            records, wall_s = await open_loop(send, plan.trace)
            points.append(point_stats(records, wall_s, pools, plan.slo_ttft_ms, plan.slo_itl_ms))
        else:
            assert plan.synthetic is not None
            for point, concurrency in enumerate(plan.concurrency):
                records, wall_s = await closed_loop(
                    send, plan.synthetic, concurrency, plan.requests_per_point, plan.duration_s, point
                )
                points.append(
                    point_stats(records, wall_s, pools, plan.slo_ttft_ms, plan.slo_itl_ms, concurrency)
                )
    workload: dict[str, Any]
    if plan.trace is not None:
        workload = {
            "kind": "trace",
            "requests": len(plan.trace),
            "clipped": sum(r.clipped for r in plan.trace),
        }
    else:
        assert plan.synthetic is not None
        workload = {"kind": "synthetic", **vars(plan.synthetic)}
        workload |= {"requests_per_point": plan.requests_per_point, "duration_s": plan.duration_s}
    return {
        "deployment": {
            "addr": options.addr,
            "model": reply.model,
            "prefill_ranks": pools.prefill_ranks,
            "decode_ranks": pools.decode_ranks,
            "colocated_ranks": pools.colocated_ranks,
        },
        "workload": workload,
        "points": points,
    }


def run_serve_bench(args: argparse.Namespace) -> int:
    """``tandem bench serve``: exit 0 when some request completed, 1 when none did or the
    deployment did not answer, 2 for a bad option."""
    from tandem.bench.serve_report import format_markdown, format_table, to_json

    token = args.token
    if args.token_file is not None:
        try:
            token = args.token_file.read_text().strip()
        except OSError as exc:
            raise InvalidRequestError(
                "--token-file", f"cannot read {args.token_file}: {exc.strerror}"
            ) from None
    if args.timeout is not None and not args.timeout > 0:
        raise InvalidRequestError("--timeout", f"must be > 0 seconds, got {args.timeout}")
    plan = plan_from_args(args)
    price = args.gpu_hour_price
    if price is not None and not (math.isfinite(price) and price > 0):
        raise InvalidRequestError("--gpu-hour-price", f"must be > 0, got {price}")
    if not 0.0 <= args.cached_token_weight <= 1.0:
        raise InvalidRequestError(
            "--cached-token-weight", f"must be in [0, 1], got {args.cached_token_weight}"
        )
    if args.plot is not None:
        from tandem.bench.serve_plots import check_matplotlib

        check_matplotlib()  # before the run, not after it
    options = ClientOptions(args.addr, token or None, args.tls_ca, timeout_s=args.timeout)
    try:
        result = asyncio.run(run_plan(options, plan))
    except DeploymentUnreachable as exc:
        print(f"tandem: error: {exc}", file=sys.stderr)
        return 1
    if price is not None:
        result["gpu_hour_price"] = price
        for point in result["points"]:
            point["price_per_mtok"] = point_prices(
                point, result["deployment"], price, args.cached_token_weight
            )
    if args.json:
        emit(to_json(result))
    elif args.markdown:
        emit(format_markdown(result))
    else:
        emit(format_table(result))
    if args.plot is not None:
        from tandem.bench.serve_plots import write_plots

        for path in write_plots(result, args.plot):
            print(f"wrote {path}", file=sys.stderr)
    return 0 if any(p["completed"] for p in result["points"]) else 1
