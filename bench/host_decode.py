"""What a decode step costs beyond the model: the inter-token latency a gRPC client sees against
the bare forward of the same model at the same batch, side by side in one run.

    bare:     the model in this process (no Ray, no gRPC), ``run_batch`` of the engine bench at
              batch C: the mean decode step's forward, on as many threads as a rank uses
    served:   a deployment of one-rank groups (one prefill rank, one decode rank: no collective),
              ``tandem bench serve``'s closed loop at concurrency C; the client's ITL P50
    ratio:    served ITL P50 / bare forward, per concurrency

The two alternate: a round of the bare forward (in this process, beside the idle deployment),
then a round served (C requests at once), ``rounds`` times; each round's ratio is of two figures
taken a moment apart, and the point reports the median round (a shared machine's load moves
both by a fifth from one minute to the next).

Cores (on a machine of two or more): each rank is pinned to a core of its own as far as they go
(``pin_cores_per_rank: 1``; the prefill rank on core 0, the decode rank on core 1) and the
frontend to every core but the decode rank's (``frontend_cores``), as a deployment keeps its
frontend off its ranks' cores; this process runs its served rounds (the gRPC client) on the
frontend's cores and its bare rounds on the decode rank's core, so both sides of a ratio run on
the same core. Unpinned, a token push wakes the frontend on the decode rank's core, where it
preempts the step loop while it handles the push (``engine/cpu_affinity.py``).

The decode rank's step split over the same point comes from its own counters (each piece timed
around itself on the rank's clock, differences of two readings of the rank's stats): forward,
sampling, scheduling and metadata, waiting (idle and the group's agreement), token push.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.engine.cpu_affinity import node_cores, pin_process
from tandem.wire.messages import RankStats, Role

PROMPT_TOKENS, OUTPUT_TOKENS, ROUNDS = 32, 256, 3


@dataclass(frozen=True)
class DecodeOptions:
    concurrency: tuple[int, ...] = (1, 8)
    prompt_tokens: int = PROMPT_TOKENS
    output_tokens: int = OUTPUT_TOKENS
    rounds: int = ROUNDS  # bare and served rounds per point, alternating (C requests a round)
    model_dir: Path | None = None
    dtype: str = "float32"
    pin: bool = True  # ranks, frontend and this process on cores of their own (``BenchCores``)


@dataclass(frozen=True)
class BenchCores:
    """The prefill rank on core 0 and the decode rank on core 1 (``pin_cores_per_rank: 1``, in
    deployment order), the frontend and the client on every core but the decode rank's."""

    decode: tuple[int, ...]
    frontend: tuple[int, ...]

    @staticmethod
    def of(total: int) -> BenchCores | None:
        """The cores on a node of ``total``; None on one core (nothing to keep apart)."""
        if total < 2:
            return None
        return BenchCores((1,), tuple(c for c in range(total) if c != 1))


class BareForward:
    """The model in this process (no Ray, no gRPC), on as many threads as a rank uses: the mean
    decode step of ``run_batch`` (the engine bench) at a batch, whole and its forward."""

    def __init__(self, options: DecodeOptions, threads: int) -> None:
        from tandem.bench.engine_bench import run_batch
        from tandem.cluster.serve import demo_model_dir
        from tandem.engine.colocated import ColocatedEngine
        from tandem.engine.engine_config import EngineConfig
        from tandem.model.dtypes import DTYPES

        self.options, self.threads, self._run_batch = options, threads, run_batch
        with self._threads():
            self.engine = ColocatedEngine.from_model_dir(
                options.model_dir or demo_model_dir(),
                DTYPES[options.dtype],
                EngineConfig(max_num_seqs=max(options.concurrency), enable_prefix_caching=False),
            )
            run_batch(self.engine, 2, options.prompt_tokens, 4, seed=99, temperature=0.0)  # warm-up

    @contextlib.contextmanager
    def _threads(self) -> Iterator[None]:
        import torch

        before = torch.get_num_threads()
        torch.set_num_threads(self.threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)

    def measure(self, batch: int, seed: int) -> dict[str, float]:
        o = self.options
        with self._threads():
            run = self._run_batch(
                self.engine, batch, o.prompt_tokens, o.output_tokens, seed=seed, temperature=0.0
            )
        return {"step_ms": run["decode_step_ms"], "forward_ms": run["decode_forward_ms"]}


def step_split(before: RankStats, after: RankStats) -> dict[str, Any]:
    """The decode rank's mean step between two readings of its stats, in milliseconds."""
    steps = after.loop.steps - before.loop.steps
    if steps <= 0:
        return {"steps": 0}
    a, b, la, lb = after.split, before.split, after.loop, before.loop

    def ms(seconds: float) -> float:
        return round(1e3 * seconds / steps, 4)

    forward_s = a.forward_s - b.forward_s
    loop_s = (la.step_s - lb.step_s) + (la.tick_s - lb.tick_s) + (la.publish_s - lb.publish_s)
    return {
        "steps": steps,
        # what the rank's loop spends a step (step, tick, push) over its forward, all on its clock
        "loop_over_forward": round(loop_s / forward_s, 3) if forward_s > 0 else None,
        "forward_ms": ms(forward_s),
        "sampling_ms": ms(a.sample_s - b.sample_s),
        "scheduling_and_metadata_ms": ms(
            (a.schedule_s - b.schedule_s) + (a.prepare_s - b.prepare_s) + (a.update_s - b.update_s)
        ),
        "tick_ms": ms(la.tick_s - lb.tick_s),
        "waiting_ms": ms((la.idle_s - lb.idle_s) + (la.agree_s - lb.agree_s)),
        "token_push_ms": ms(la.publish_s - lb.publish_s),
        "step_ms": ms(la.step_s - lb.step_s),
    }


def _decode_stats(controller: Any) -> RankStats:
    import ray

    stats = [s for s in ray.get(controller.stats.remote()) if s.role is Role.DECODE]
    if len(stats) != 1:
        raise RuntimeError(f"expected one decode rank, found {len(stats)}")
    return stats[0]


def measure_decode(options: DecodeOptions | None = None) -> dict[str, Any]:
    """The ``decode`` part of ``tandem bench host``: bare and served rounds, alternating."""
    from tandem.bench.serve_bench import Plan, run_plan
    from tandem.bench.serve_workload import SyntheticWorkload
    from tandem.client.grpc_client import ClientOptions
    from tandem.cluster.ray_bootstrap import init_ray, shutdown_ray
    from tandem.cluster.serve import ServeOptions, Server
    from tandem.cluster.topology import PoolSpec, Topology
    from tandem.model.config import ModelConfig

    o = options or DecodeOptions()
    cores = BenchCores.of(node_cores()) if o.pin else None
    threads = 1 if cores is not None else int(os.environ.get("TANDEM_RANK_THREADS", "1"))
    bare = BareForward(o, threads)
    topology = Topology(
        name="host-bench",
        prefill=PoolSpec(groups=1, dep=1, max_num_seqs=max(o.concurrency)),
        decode=PoolSpec(groups=1, dep=1, max_num_seqs=max(o.concurrency)),
        pin_cores_per_rank=1 if cores is not None else None,
        frontend_cores=list(cores.frontend) if cores is not None else None,
    )
    own = os.sched_getaffinity(0)

    def on(side: str) -> None:  # this process's next round on the decode rank's or the frontend's cores
        if cores is not None:
            pin_process(cores.decode if side == "decode" else cores.frontend)

    points = []
    init_ray()
    try:
        server = Server(ServeOptions(topology, o.model_dir, port=0, dtype=o.dtype))
        server.start()
        try:
            vocab = ModelConfig.from_dir(server.model_dir).vocab_size
            client = ClientOptions(f"127.0.0.1:{server.port}")
            warm = SyntheticWorkload(o.prompt_tokens, 4, 0, 1, vocab, seed=1)
            asyncio.run(run_plan(client, Plan((2,), warm, requests_per_point=4)))
            for c in o.concurrency:
                points.append(_decode_point(c, o, bare, server.controller, client, vocab, on))
        finally:
            server.stop()
    finally:
        pin_process(own)
        shutdown_ray()
    return {
        "rank_threads": threads,
        "cores": None if cores is None else {"decode_rank": cores.decode, "frontend": cores.frontend},
        "prompt_tokens": o.prompt_tokens,
        "output_tokens": o.output_tokens,
        "points": points,
        "decode_itl_over_forward": points[0]["itl_over_forward"] if points else None,
    }


def _decode_point(
    c: int,
    o: DecodeOptions,
    bare: BareForward,
    controller: Any,
    client: Any,
    vocab: int,
    on: Callable[[str], None],
) -> dict[str, Any]:
    """One concurrency: a round of the bare forward, then a round served, ``rounds`` times: each
    ratio is of two figures taken a moment apart, as the machine's load moves. The median
    round's figures, and the decode step's split over all of them."""
    from tandem.bench.serve_bench import Plan, run_plan
    from tandem.bench.serve_workload import SyntheticWorkload

    pairs = []
    before = _decode_stats(controller)
    for r in range(o.rounds):
        on("decode")
        forward = bare.measure(c, seed=100 * c + r)
        workload = SyntheticWorkload(o.prompt_tokens, o.output_tokens, 0, 1, vocab, seed=c + 2 + r)
        on("frontend")
        result = asyncio.run(run_plan(client, Plan((c,), workload, requests_per_point=c)))
        point = result["points"][0]
        pairs.append((point["itl_ms"]["p50"], point["itl_ms"]["p90"], forward))
    after = _decode_stats(controller)
    ratios = [itl / forward["forward_ms"] for itl, _, forward in pairs]
    median = sorted(range(len(pairs)), key=lambda i: ratios[i])[len(pairs) // 2]
    itl_ms, itl_p90_ms, forward = pairs[median]
    return {
        "concurrency": c,
        "itl_p50_ms": round(itl_ms, 3),
        "itl_p90_ms": round(itl_p90_ms, 3),
        "bare_forward_ms": forward["forward_ms"],
        "bare_step_ms": forward["step_ms"],
        "itl_over_forward": round(ratios[median], 3),
        "rounds_itl_over_forward": [round(x, 3) for x in ratios],
        "decode_step": step_split(before, after),
    }
