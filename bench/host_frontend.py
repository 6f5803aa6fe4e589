"""The frontend's capacity: streamed tokens per second per core through the real frontend actor
(gRPC server, routing over the prefill ranks' KV events, pushes from the ranks, incremental
detokenisation, chunks, bills and metrics) with ranks that make tokens without a model
(``bench/fake_ranks.py``) and real ``grpc.aio`` streaming clients in a process of their own
(``bench/frontend_load.py``).

What is sent and streamed is a workload (``bench/frontend_workload.py``): ``realistic`` (the
default) with the bench tokenizer's 100,000 ids trained here on real text
(``bench/bench_tokenizer.py``), prompts of 1-4k tokens of real text behind four shared prefixes
of 512-2,048 tokens, which the frontend hashes by page and routes on the prefix index its prefill
ranks' KV events keep (each fake prefill rank caches what it is sent in a prefix cache of a fixed
size, evicting, and publishes the events as a real one), and every stream a passage of its own
of English, other languages (characters split across tokens) or code; ``easy``, the case
measured before, with the demo's 258 ids, one 32-token prompt (no page to hash) and one cyclic
stream for all, on which the detokeniser's caches hit almost always. ``workload="both"`` runs
both, one after the other in one Ray, and reports both figures side by side.

For each concurrency the clients run ``streams`` requests of ``output_tokens`` tokens at once;
the fake ranks make no step until every one of them runs (a deployment at steady state holds
its streams however fast its frontend admitted them), then a step of each rank every
``step_ms`` gives every stream it holds a token. The frontend's CPU is read inside its process
before and after (``Frontend.clock``: ``time.process_time``, every thread): a round's CPU holds
its admissions (prompts parsed, hashed, routed, submitted) and the KV events applied as well as
the streaming. The figure to read is ``tokens_per_s_per_core = tokens / frontend CPU seconds``
of a round (the median of ``repeats`` rounds: one round's figure moves by a fifth on a small,
shared machine); ``tokens_per_s`` is the clients' rate on their own clock (on a small machine
the clients and the fake ranks take cores too, so it is the lesser figure). The router's
counters (``ClusterStatus``, read outside the timed span) give each round's blocks hashed and
matched, and KV events applied. A further round at the same concurrency runs with the
frontend's event loop thread under cProfile and says where its time went, by category of each
function's own time; cProfile slows what it watches, so no rate is taken from that round.

What it still leaves out: a model (outputs are passages of the corpus at a fixed step, never a
stop string or EOS: every stream runs to ``max_tokens``, none is cancelled); arrivals over time
(each round's streams start together and end together); prefill compute and KV transfer (a
prefill rank answers at once and the bill's figures are the fake ranks'); text prompts (no
encoding or chat template at the frontend), the OpenAI HTTP server, TLS and auth; rank
failures, drains and resumed requests; more than one frontend. The tokenizer learnt its merges
from this machine's text, much of it Python source, so they are not a production tokenizer's
(the report gives its size and the corpus's shares). The clients and fake ranks share the
machine's cores with the frontend.

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

import grpc
import ray

from tandem.bench.fake_ranks import (
    FAKE_PREFILL_PAGES,
    FakeController,
    FakeDecodeRank,
    FakePrefillCounts,
    FakePrefillRank,
    FakeRankCounts,
)
from tandem.bench.frontend_load import LoadOrder, LoadResult, client_process
from tandem.bench.frontend_workload import WORKLOADS, FrontendWorkload, build_workload, prompt_facts
from tandem.bench.serve_stats import percentile
from tandem.cluster.ray_bootstrap import init_ray
from tandem.frontend.actor import Frontend
from tandem.frontend.core import FrontendConfig
from tandem.frontend.diagnostics import ProcessClock, ProfileRow
from tandem.frontend.limits import EdgeLimits
from tandem.protos import tandem_pb2, tandem_pb2_grpc
from tandem.wire.messages import RankId

# each fake decode rank's step: with two ranks at 256 streams they offer 128,000 tokens/s, more
# than a frontend core takes, while every stream runs at once as on a deployment
STEP_MS = 2.0
WARMUP_TOKENS = 4

# a function's own time goes to the first category one of whose markers is in "file:function"
CATEGORIES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("detokenisation", ("tokenizer.py", "tokenizers.")),
    # the edge's checks of each prompt, token by token (its isinstance calls fall in "other")
    ("prompt_checks", ("engine/request.py",)),
    ("bills_metrics", ("prometheus_client", "/metrics/")),
    ("grpc_send", ("grpc", "protobuf", "_pb2")),
    (
        "routing",
        (
            "/router/",
            "prefix_cache.py",
            "core.py:_send",
            "hashlib",
            "_blake",
            "kv_event_feed.py",
            "push_kv_events",
            "on_kv_events",
        ),
    ),
    (
        "push_handling",
        ("request_stream.py", "core.py:on_stream", "rank_channel.py", "/ray/", "pickle", "_raylet"),
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


@dataclass(frozen=True)
class RouterReading:
    """The frontend's router as its ``ClusterStatus`` reports it: totals since it started."""

    requests_routed: int
    blocks_hashed: int  # full pages of the routed prompts, each hashed by the frontend
    blocks_matched: int  # of those, found on the chosen prefill rank by the router's index
    events_applied: int  # KV events from the prefill ranks applied to the index
    indexed_blocks: int  # blocks the index holds now, over every prefill rank


@dataclass
class _Bench:
    workload: FrontendWorkload
    frontend: Any
    ranks: list[Any]
    prefill: list[Any]
    actors: list[Any]
    pipe: Any
    process: Any
    status: Any  # the frontend's gRPC stub, for ClusterStatus
    channel: Any


def _start(
    workload: FrontendWorkload,
    decode_ranks: int,
    prefill_ranks: int,
    prefill_pages: int,
    step_s: float,
    stream_interval: int,
    channels: int,
) -> _Bench:
    suffix = uuid.uuid4().hex[:8]
    prefill_ids = [RankId(f"bench-prefill-{suffix}", r) for r in range(prefill_ranks)]
    prefill = {r: FakePrefillRank.remote(r, prefill_pages) for r in prefill_ids}  # type: ignore[attr-defined]
    decode_ids = [RankId(f"bench-decode-{suffix}", r) for r in range(decode_ranks)]
    ranks = [
        FakeDecodeRank.remote(r, prefill, workload, step_s)  # type: ignore[attr-defined]
        for r in decode_ids
    ]
    controller_name = f"tandem-bench-controller-{suffix}"
    controller = FakeController.options(name=controller_name).remote(  # type: ignore[attr-defined]
        prefill, dict(zip(decode_ids, ranks, strict=True))
    )
    config = FrontendConfig(
        workload.model_dir,
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
    address = f"127.0.0.1:{port}"
    process = context.Process(target=client_process, args=(address, workload, channels, child), daemon=True)
    process.start()
    if not pipe.poll(60) or pipe.recv() != "ready":
        raise RuntimeError("the client process did not connect to the frontend within 60 s")
    channel = grpc.insecure_channel(address)
    actors = [*prefill.values(), controller, *ranks, frontend]
    stub = tandem_pb2_grpc.TandemStub(channel)
    return _Bench(workload, frontend, ranks, list(prefill.values()), actors, pipe, process, stub, channel)


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


def _prefill_counts(bench: _Bench) -> FakePrefillCounts:
    counts: list[FakePrefillCounts] = ray.get([r.counts.remote() for r in bench.prefill])
    fields = ("jobs", "event_batches", "blocks_stored", "blocks_removed")
    return FakePrefillCounts(*(sum(getattr(c, f) for c in counts) for f in fields))


def read_router(bench: _Bench) -> RouterReading:
    """The router's counters and the blocks it indexes, by ``ClusterStatus`` (frontend CPU of
    its own: read outside a round's timed span)."""
    status = bench.status.ClusterStatus(tandem_pb2.ClusterStatusRequest(), timeout=30)
    counters = dict(status.router_counters)
    indexed = sum(r.indexed_blocks for g in status.groups for r in g.ranks if r.role == "prefill")
    return RouterReading(
        counters.get("requests_routed", 0),
        counters.get("queried_blocks", 0),
        counters.get("matched_blocks", 0),
        counters.get("events_applied", 0),
        indexed,
    )


def _measured(bench: _Bench, order: LoadOrder, timeout_s: float) -> dict[str, Any]:
    router0, prefill0 = read_router(bench), _prefill_counts(bench)
    ranks0 = _counts(bench)
    submits0: dict[str, int] = ray.get(bench.frontend.submits.remote())
    clock0: ProcessClock = ray.get(bench.frontend.clock.remote())
    result = _round(bench, order, timeout_s)
    clock1: ProcessClock = ray.get(bench.frontend.clock.remote())
    submits1: dict[str, int] = ray.get(bench.frontend.submits.remote())
    ranks1 = _counts(bench)
    router1, prefill1 = read_router(bench), _prefill_counts(bench)
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
        "submits": {way: submits1[way] - submits0[way] for way in ("channel", "unreachable")},
        "tokens_per_push": round((ranks1.tokens - ranks0.tokens) / max(pushes, 1), 1),
        "frontend_ttft_ms": _percentiles_ms(result.frontend_ttft_s),
        "client_ttft_ms": _percentiles_ms(result.client_ttft_s),
        **prompt_facts(bench.workload, [(order.round_id, order.streams)]),
        "requests_routed": router1.requests_routed - router0.requests_routed,
        "blocks_hashed": router1.blocks_hashed - router0.blocks_hashed,
        "blocks_matched": router1.blocks_matched - router0.blocks_matched,
        "kv_events_applied": router1.events_applied - router0.events_applied,
        "kv_event_batches_pushed": prefill1.event_batches - prefill0.event_batches,
        "kv_blocks_stored": prefill1.blocks_stored - prefill0.blocks_stored,
        "kv_blocks_removed": prefill1.blocks_removed - prefill0.blocks_removed,
        "indexed_blocks": router1.indexed_blocks,
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


@dataclass(frozen=True)
class _Plan:
    streams: tuple[int, ...]
    output_tokens: int
    decode_ranks: int
    prefill_ranks: int
    prefill_pages: int
    step_ms: float
    repeats: int
    stream_interval: int
    profile: bool
    top: int
    timeout_s: float


def measure_frontend(
    streams: tuple[int, ...] = (64, 256),
    output_tokens: int = 256,
    address: str | None = None,
    decode_ranks: int = 2,
    step_ms: float = STEP_MS,
    repeats: int = 3,
    stream_interval: int = 1,
    profile: bool = True,
    top: int = 15,
    workload: str = "realistic",
    prefill_ranks: int = 2,
    prefill_pages: int = FAKE_PREFILL_PAGES,
    timeout_s: float = 300.0,
) -> dict[str, Any]:
    """Streamed tokens per second per frontend core at each concurrency in ``streams``, for
    ``workload`` (``realistic``, ``easy`` or ``both``); ``frontend_tokens_per_s_per_core`` is
    the figure at 256 streams (else at the largest). With ``both``, the result is the realistic
    workload's with the easy one's under ``easy`` and both figures under ``side_by_side``."""
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
    names = WORKLOADS if workload == "both" else (workload,)
    if any(name not in WORKLOADS for name in names):
        raise ValueError(f"workload: expected one of {', '.join(WORKLOADS)} or both, got {workload!r}")
    if decode_ranks < 1 or prefill_ranks < 1:
        raise ValueError(f"decode_ranks, prefill_ranks: at least 1 each, got {decode_ranks}, {prefill_ranks}")
    plan = _Plan(
        streams,
        output_tokens,
        decode_ranks,
        prefill_ranks,
        prefill_pages,
        step_ms,
        repeats,
        stream_interval,
        profile,
        top,
        timeout_s,
    )
    started_ray = not ray.is_initialized()
    init_ray(address)
    try:
        results = {name: _measure_workload(build_workload(name), plan) for name in names}
    finally:
        if started_ray:
            ray.shutdown()
    out = results[names[0]]
    if len(results) > 1:
        out = out | {
            "easy": results["easy"],
            "side_by_side": {
                name: {n: r["by_streams"][n]["tokens_per_s_per_core"] for n in r["by_streams"]}
                for name, r in results.items()
            },
        }
    return out


def _measure_workload(workload: FrontendWorkload, plan: _Plan) -> dict[str, Any]:
    streams, timeout_s = plan.streams, plan.timeout_s
    channels = max(1, max(streams) // 64)
    bench = _start(
        workload,
        plan.decode_ranks,
        plan.prefill_ranks,
        plan.prefill_pages,
        plan.step_ms / 1e3,
        plan.stream_interval,
        channels,
    )
    measured: list[tuple[str, int]] = []
    try:
        # first contacts: channels, actor handles, the ranks' loops; the shared prefixes cached
        _round(bench, LoadOrder(min(streams), WARMUP_TOKENS, "warmup"), timeout_s)
        rounds: dict[str, Any] = {}
        for n in streams:
            orders = [LoadOrder(n, plan.output_tokens, f"s{n}-{i}") for i in range(plan.repeats)]
            runs = [_measured(bench, order, timeout_s) for order in orders]
            measured += [(order.round_id, n) for order in orders]
            # the round with the median figure stands for the concurrency; every round's figure is kept
            runs.sort(key=lambda r: r["tokens_per_s_per_core"])
            figures = runs[len(runs) // 2] | {
                "rounds_tokens_per_s_per_core": [r["tokens_per_s_per_core"] for r in runs]
            }
            if plan.profile:
                order = LoadOrder(n, plan.output_tokens, f"p{n}")
                figures["profile"] = _profiled(bench, order, timeout_s, plan.top)
            rounds[str(n)] = figures
        router = read_router(bench)
        prefill = _prefill_counts(bench)
    finally:
        _stop(bench)
    at = "256" if "256" in rounds else str(max(streams))
    prompts = prompt_facts(workload, measured)
    return {
        "frontend_tokens_per_s_per_core": rounds[at]["tokens_per_s_per_core"],
        "at_streams": int(at),
        "workload": workload.name,
        "vocab_size": workload.vocab_size,
        "output_tokens": plan.output_tokens,
        "prompt_tokens": round(prompts["prompt_tokens"]["mean"]),
        "decode_ranks": plan.decode_ranks,
        "prefill_ranks": plan.prefill_ranks,
        "prefill_cache_pages": plan.prefill_pages,
        "rank_step_ms": plan.step_ms,
        "stream_interval": plan.stream_interval,
        # what was sent and streamed, over the measured rounds; the router's and the prefill
        # ranks' totals over the whole run (warm-up and profiled rounds too)
        "workload_facts": workload.facts | prompts,
        "routing": {
            "requests_routed": router.requests_routed,
            "blocks_hashed": router.blocks_hashed,
            "blocks_matched": router.blocks_matched,
            "kv_events_applied": router.events_applied,
            "indexed_blocks": router.indexed_blocks,
            "prefill_jobs": prefill.jobs,
            "kv_event_batches_pushed": prefill.event_batches,
            "kv_blocks_stored": prefill.blocks_stored,
            "kv_blocks_removed": prefill.blocks_removed,
        },
        "by_streams": rounds,
    }


def _stop(bench: _Bench) -> None:
    bench.channel.close()
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
