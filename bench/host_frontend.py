"""The frontend's capacity: streamed tokens per second per core through the real frontend actor
(gRPC server, routing, pushes from the ranks, incremental detokenisation, chunks, bills and
metrics) with decode ranks that make tokens without a model (``bench/fake_ranks.py``) and real
``grpc.aio`` streaming clients in a process of their own (``bench/frontend_load.py``).

For each concurrency the clients run ``streams`` requests of ``output_tokens`` tokens at once;
the fake ranks make no step until every one of them runs (a deployment at steady state holds
its streams however fast its frontend admitted them), then a step of each rank every
``step_ms`` gives every stream it holds a token. The frontend's CPU is read inside its process
before and after (``Frontend.clock``: ``time.process_time``, every thread). The figure to read
is ``tokens_per_s_per_core = tokens / frontend CPU seconds`` of a round (the median of
``repeats`` rounds: one round's figure moves by a fifth on a small, shared machine);
``tokens_per_s`` is the clients' rate on their own clock (on a small machine the clients and the
fake ranks take cores too, so it is the lesser figure). A further round at the same concurrency
runs with the frontend's event loop thread under cProfile and says where its time went, by
category of each function's own time; cProfile slows what it watches, so no rate is taken
from that round.

``python -c "from tandem.bench.host_frontend import measure_frontend; print(measure_frontend())"``
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray

from tandem.bench.fake_ranks import FakeController, FakeDecodeRank, FakePrefillRank, FakeRankCounts
from tandem.bench.frontend_load import LoadOrder, LoadResult, client_process
from tandem.bench.serve_stats import percentile
from tandem.cluster.ray_bootstrap import init_ray
from tandem.cluster.serve import demo_model_dir
from tandem.engine.messages import RankId
from tandem.frontend.actor import Frontend
from tandem.frontend.core import FrontendConfig
from tandem.frontend.diagnostics import ProcessClock, ProfileRow
from tandem.frontend.limits import EdgeLimits
from tandem.model.tokenizer import Tokenizer

# what the fake ranks stream: English with a few multi-byte characters, so that incremental
# detokenisation holds back partial characters as it would on a real model's output
SAMPLE_TEXT = (
    "In the beginning the frontend took every token the decode ranks pushed, turned it into text "
    "and sent it on \u2014 chunk after chunk, stream after stream \u2014 to clients near and far: "
    "caf\u00e9, na\u00efve, \u00fcber, \u6570\u636e. "
)
PROMPT_TOKENS = 32
# each fake decode rank's step: with two ranks at 256 streams they offer 128,000 tokens/s, more
# than a frontend core takes, while every stream runs at once as on a deployment
STEP_MS = 2.0

# a function's own time goes to the first category one of whose markers is in "file:function"
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("detokenisation", ("tokenizer.py", "tokenizers.")),
    ("bills_metrics", ("prometheus_client", "/metrics/")),
    ("grpc_send", ("grpc", "protobuf", "_pb2")),
    ("routing", ("/router/", "prefix_cache.py", "_route_and_submit", "hashlib", "_blake")),
    (
        "push_handling",
        ("request_stream.py", "core.py:on_stream", "push_stream", "/ray/", "pickle", "_raylet"),
    ),
    ("stream_loop", ("core.py:generate", "frontend/core.py")),
    ("event_loop", ("asyncio", "selectors", "_contextvars")),
)


def categorise(rows: list[ProfileRow]) -> dict[str, float]:
    """Seconds of own time by category (``other``: what no marker names)."""
    out = {name: 0.0 for name, _ in CATEGORIES} | {"other": 0.0}
    for row in rows:
        where = f"{row.file}:{row.function}".replace("\\", "/")
        name = next((n for n, markers in CATEGORIES if any(m in where for m in markers)), "other")
        out[name] += row.own_s
    return out


@dataclass
class _Bench:
    frontend: Any
    ranks: list[Any]
    actors: list[Any]
    pipe: Any
    process: Any


def _expected_tokens(tokenizer: Tokenizer) -> tuple[int, ...]:
    special = {tokenizer.bos_token_id, tokenizer.eos_token_id}
    return tuple(t for t in tokenizer.encode(SAMPLE_TEXT) if t not in special)


def _start(
    model_dir: Path,
    decode_ranks: int,
    window: int,
    step_s: float,
    stream_interval: int,
    channels: int,
    stream_tokens: tuple[int, ...],
) -> _Bench:
    suffix = uuid.uuid4().hex[:8]
    prefill_id = RankId(f"bench-prefill-{suffix}", 0)
    prefill = FakePrefillRank.remote(prefill_id)  # type: ignore[attr-defined]
    decode_ids = [RankId(f"bench-decode-{suffix}", r) for r in range(decode_ranks)]
    ranks = [
        FakeDecodeRank.remote(r, prefill_id, stream_tokens, window, step_s)  # type: ignore[attr-defined]
        for r in decode_ids
    ]
    controller_name = f"tandem-bench-controller-{suffix}"
    controller = FakeController.options(name=controller_name).remote(  # type: ignore[attr-defined]
        {prefill_id: prefill}, dict(zip(decode_ids, ranks, strict=True))
    )
    config = FrontendConfig(
        str(model_dir),
        "bench",
        port=0,
        controller=controller_name,
        name=f"tandem-bench-frontend-{suffix}",
        limits=EdgeLimits(stream_interval=stream_interval),
    )
    frontend = Frontend.options(name=config.name).remote(config)  # type: ignore[attr-defined]
    port = ray.get(frontend.start.remote(), timeout=60)
    if not ray.get(frontend.wait_ready.remote(30.0), timeout=60):
        raise RuntimeError("the frontend did not become ready over the fake ranks within 30 s")
    context = multiprocessing.get_context("spawn")
    pipe, child = context.Pipe()
    process = context.Process(
        target=client_process, args=(f"127.0.0.1:{port}", stream_tokens, channels, child), daemon=True
    )
    process.start()
    if not pipe.poll(60) or pipe.recv() != "ready":
        raise RuntimeError("the client process did not connect to the frontend within 60 s")
    return _Bench(frontend, ranks, [prefill, controller, *ranks, frontend], pipe, process)


def _round(bench: _Bench, order: LoadOrder, timeout_s: float) -> LoadResult:
    """One round; the ranks make no step until every stream of it runs on one of them."""
    ray.get([r.hold.remote() for r in bench.ranks])
    bench.pipe.send(order)
    deadline = time.monotonic() + timeout_s
    try:
        while sum(ray.get([r.running.remote() for r in bench.ranks])) < order.streams:
            if time.monotonic() > deadline or bench.pipe.poll(0):  # the clients gave up early
                break
            time.sleep(0.002)
    finally:
        ray.get([r.release.remote() for r in bench.ranks])
    if not bench.pipe.poll(max(0.0, deadline - time.monotonic())):
        raise RuntimeError(f"round {order.round_id}: the clients did not finish within {timeout_s} s")
    result: LoadResult = bench.pipe.recv()
    if result.errors:
        raise RuntimeError(
            f"round {order.round_id}: {result.completed}/{result.streams} streams right; {result.errors}"
        )
    return result


def _counts(bench: _Bench) -> FakeRankCounts:
    counts: list[FakeRankCounts] = ray.get([r.counts.remote() for r in bench.ranks])
    return FakeRankCounts(
        *(sum(getattr(c, f) for c in counts) for f in ("steps", "pushes", "tokens", "results"))
    )


def _measured(bench: _Bench, order: LoadOrder, timeout_s: float) -> dict[str, Any]:
    ranks0 = _counts(bench)
    submits0: dict[str, int] = ray.get(bench.frontend.submits.remote())
    clock0: ProcessClock = ray.get(bench.frontend.clock.remote())
    result = _round(bench, order, timeout_s)
    clock1: ProcessClock = ray.get(bench.frontend.clock.remote())
    submits1: dict[str, int] = ray.get(bench.frontend.submits.remote())
    ranks1 = _counts(bench)
    cpu_s = clock1.process_cpu_s - clock0.process_cpu_s
    wall_s = clock1.monotonic_s - clock0.monotonic_s
    pushes = ranks1.pushes - ranks0.pushes
    return {
        "streams": order.streams,
        "output_tokens": order.output_tokens,
        "tokens": result.tokens,
        "client_wall_s": round(result.wall_s, 4),
        "tokens_per_s": round(result.tokens / result.wall_s, 1),
        "client_cpu_s": round(result.cpu_s, 4),
        "frontend_cpu_s": round(cpu_s, 4),
        "frontend_loop_thread_cpu_s": round(clock1.thread_cpu_s - clock0.thread_cpu_s, 4),
        "frontend_wall_s": round(wall_s, 4),
        "frontend_cores_busy": round(cpu_s / wall_s, 3),
        "tokens_per_s_per_core": round(result.tokens / cpu_s, 1),
        "frontend_cpu_us_per_token": round(1e6 * cpu_s / result.tokens, 2),
        # the cyclic collector's seconds over the frontend's CPU seconds of the round
        "frontend_gc_share": round((clock1.gc_s - clock0.gc_s) / cpu_s, 4),
        "frontend_gc_collections": clock1.gc_collections - clock0.gc_collections,
        "messages": result.messages,
        "tokens_per_message": round(result.tokens / max(result.messages, 1), 2),
        "rank_pushes": pushes,
        "submits": {way: submits1[way] - submits0[way] for way in ("socket", "actor")},
        "tokens_per_push": round((ranks1.tokens - ranks0.tokens) / max(pushes, 1), 1),
        "frontend_ttft_ms": _percentiles_ms(result.frontend_ttft_s),
        "client_ttft_ms": _percentiles_ms(result.client_ttft_s),
    }


def _percentiles_ms(values: tuple[float, ...]) -> dict[str, float]:
    if not values:
        return {}
    at = {"p50": 50, "p90": 90, "max": 100}
    return {k: round(1e3 * percentile(values, q), 3) for k, q in at.items()}


def _profiled(bench: _Bench, order: LoadOrder, timeout_s: float, top: int) -> dict[str, Any]:
    ray.get(bench.frontend.start_profile.remote())
    try:
        _round(bench, order, timeout_s)
    finally:
        rows: list[ProfileRow] = ray.get(bench.frontend.stop_profile.remote())
    total = sum(r.own_s for r in rows)
    by_category = categorise(rows)
    return {
        "profiled_s": round(total, 4),
        "share": {name: round(s / total, 4) if total else 0.0 for name, s in by_category.items()},
        "top": [f"{r.own_s / total:6.1%} {r.calls:>8} {Path(r.file).name}:{r.function}" for r in rows[:top]]
        if total
        else [],
    }


def measure_frontend(
    streams: tuple[int, ...] = (64, 256),
    output_tokens: int = 256,
    address: str | None = None,
    decode_ranks: int = 2,
    window: int = 8,
    step_ms: float = STEP_MS,
    repeats: int = 3,
    stream_interval: int = 1,
    profile: bool = True,
    top: int = 15,
    model_dir: Path | None = None,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Streamed tokens per second per frontend core at each concurrency in ``streams``;
    ``frontend_tokens_per_s_per_core`` is the figure at 256 streams (else at the largest)."""
    if not streams or any(s < 1 for s in streams):
        raise ValueError(f"streams: expected concurrencies of at least 1, got {streams}")
    if output_tokens < 1:
        raise ValueError(f"output_tokens: must be at least 1, got {output_tokens}")
    EdgeLimits(stream_interval=stream_interval).check()
    if repeats < 1:
        raise ValueError(f"repeats: must be at least 1, got {repeats}")
    if not 0 <= step_ms <= 1000:
        raise ValueError(f"step_ms: expected 0 to 1000 ms, got {step_ms}")
    if max(streams) > FrontendConfig.max_running_requests:
        raise ValueError(
            f"streams: at most {FrontendConfig.max_running_requests} (the frontend's max_running_requests)"
        )
    started_ray = not ray.is_initialized()
    init_ray(address)
    model_dir = model_dir or demo_model_dir()
    stream_tokens = _expected_tokens(Tokenizer.from_dir(model_dir))
    prompt = stream_tokens[:PROMPT_TOKENS]
    channels = max(1, max(streams) // 64)
    bench = _start(model_dir, decode_ranks, window, step_ms / 1e3, stream_interval, channels, stream_tokens)
    try:
        # first contacts: channels, actor handles, the ranks' loops
        _round(bench, LoadOrder(min(streams), 4, prompt, "warmup"), timeout_s)
        rounds: dict[str, Any] = {}
        for n in streams:
            runs = [
                _measured(bench, LoadOrder(n, output_tokens, prompt, f"s{n}-{i}"), timeout_s)
                for i in range(repeats)
            ]
            # the round with the median figure stands for the concurrency; every round's figure is kept
            runs.sort(key=lambda r: r["tokens_per_s_per_core"])
            figures = runs[len(runs) // 2] | {
                "rounds_tokens_per_s_per_core": [r["tokens_per_s_per_core"] for r in runs]
            }
            if profile:
                figures["profile"] = _profiled(
                    bench, LoadOrder(n, output_tokens, prompt, f"p{n}"), timeout_s, top
                )
            rounds[str(n)] = figures
    finally:
        _stop(bench)
        if started_ray:
            ray.shutdown()
    at = "256" if "256" in rounds else str(max(streams))
    return {
        "frontend_tokens_per_s_per_core": rounds[at]["tokens_per_s_per_core"],
        "at_streams": int(at),
        "output_tokens": output_tokens,
        "prompt_tokens": len(prompt),
        "decode_ranks": decode_ranks,
        "push_window": window,
        "rank_step_ms": step_ms,
        "stream_interval": stream_interval,
        "by_streams": rounds,
    }


def _stop(bench: _Bench) -> None:
    with contextlib.suppress(OSError):
        bench.pipe.send(None)
    bench.process.join(10)
    if bench.process.is_alive():
        bench.process.kill()
        bench.process.join(5)
    with contextlib.suppress(ray.exceptions.RayError):
        ray.get(bench.frontend.stop.remote(0.5), timeout=30)
    for actor in bench.actors:
        ray.kill(actor)
