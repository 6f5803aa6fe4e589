"""What a decode step costs beyond the model: the inter-token latency a gRPC client sees against
the bare forward of the same model at the same batch, side by side in one run.

    bare:     the model in this process (no Ray, no gRPC), ``run_batch`` of the engine bench at
              batch C: the mean decode step's forward, on as many threads as a rank uses
    served:   a deployment of one-rank groups (one prefill rank, one decode rank: no collective),
              ``tandem bench serve``'s closed loop at concurrency C; the client's ITL P50
    ratio:    served ITL P50 / bare forward, per concurrency

The decode rank's step split over the same point comes from its own counters (each piece timed
around itself on the rank's clock, differences of two readings of the rank's stats): forward,
sampling, scheduling and metadata, waiting (idle and the group's agreement), token push.
"""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.engine.messages import RankStats, Role

PROMPT_TOKENS, OUTPUT_TOKENS, ROUNDS = 32, 64, 3


@dataclass(frozen=True)
class DecodeOptions:
    concurrency: tuple[int, ...] = (1, 8)
    prompt_tokens: int = PROMPT_TOKENS
    output_tokens: int = OUTPUT_TOKENS
    rounds: int = ROUNDS  # requests per point: rounds x concurrency
    model_dir: Path | None = None
    dtype: str = "float32"


def bare_forward_ms(options: DecodeOptions, threads: int) -> dict[int, dict[str, float]]:
    """Per concurrency: the mean decode step of the model in this process, whole and its forward."""
    import torch

    from tandem.bench.engine_bench import run_batch
    from tandem.cluster.serve import demo_model_dir
    from tandem.engine.colocated import DTYPES, ColocatedEngine
    from tandem.engine.engine_config import EngineConfig

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        engine = ColocatedEngine.from_model_dir(
            options.model_dir or demo_model_dir(),
            DTYPES[options.dtype],
            EngineConfig(max_num_seqs=max(options.concurrency), enable_prefix_caching=False),
        )
        run_batch(engine, 2, options.prompt_tokens, 4, seed=99, temperature=0.0)  # warm-up
        out = {}
        for c in options.concurrency:
            run = run_batch(engine, c, options.prompt_tokens, options.output_tokens, seed=c, temperature=0.0)
            out[c] = {"step_ms": run["decode_step_ms"], "forward_ms": run["decode_forward_ms"]}
        return out
    finally:
        torch.set_num_threads(before)


def step_split(before: RankStats, after: RankStats) -> dict[str, Any]:
    """The decode rank's mean step between two readings of its stats, in milliseconds."""
    steps = after.loop.steps - before.loop.steps
    if steps <= 0:
        return {"steps": 0}
    a, b, la, lb = after.split, before.split, after.loop, before.loop

    def ms(seconds: float) -> float:
        return round(1e3 * seconds / steps, 4)

    return {
        "steps": steps,
        "forward_ms": ms(a.forward_s - b.forward_s),
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
    """The ``decode`` part of ``tandem bench host``: bare forward first, then the deployment."""
    from tandem.bench.serve_bench import Plan, run_plan
    from tandem.bench.serve_workload import SyntheticWorkload
    from tandem.cli.client import ClientOptions
    from tandem.cluster.ray_bootstrap import init_ray, shutdown_ray
    from tandem.cluster.serve import ServeOptions, Server
    from tandem.cluster.topology import PoolSpec, Topology
    from tandem.model.config import ModelConfig

    o = options or DecodeOptions()
    threads = int(os.environ.get("TANDEM_RANK_THREADS", "1"))
    bare = bare_forward_ms(o, threads)
    topology = Topology(
        name="host-bench",
        prefill=PoolSpec(groups=1, dep=1, max_num_seqs=max(o.concurrency)),
        decode=PoolSpec(groups=1, dep=1, max_num_seqs=max(o.concurrency)),
    )
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
                workload = SyntheticWorkload(o.prompt_tokens, o.output_tokens, 0, 1, vocab, seed=c + 2)
                plan = Plan((c,), workload, requests_per_point=o.rounds * c)
                before = _decode_stats(server.controller)
                result = asyncio.run(run_plan(client, plan))
                after = _decode_stats(server.controller)
                point = result["points"][0]
                itl_ms = point["itl_ms"]["p50"]
                forward_ms = bare[c]["forward_ms"]
                points.append(
                    {
                        "concurrency": c,
                        "itl_p50_ms": round(itl_ms, 3),
                        "itl_p90_ms": round(point["itl_ms"]["p90"], 3),
                        "bare_forward_ms": forward_ms,
                        "bare_step_ms": bare[c]["step_ms"],
                        "itl_over_forward": round(itl_ms / forward_ms, 3),
                        "decode_step": step_split(before, after),
                    }
                )
        finally:
            server.stop()
    finally:
        shutdown_ray()
    return {
        "rank_threads": threads,
        "prompt_tokens": o.prompt_tokens,
        "output_tokens": o.output_tokens,
        "points": points,
        "decode_itl_over_forward": points[0]["itl_over_forward"] if points else None,
    }
