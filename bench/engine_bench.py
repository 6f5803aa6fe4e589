"""Throughput of the colocated engine, and how much of a decode step is spent outside the model.

For each batch size: all prompts are submitted at once (random token ids, ``ignore_eos``), and
the engine runs to completion. Decode steps (every scheduled chunk is one token) are timed whole
and for their model forward alone; the remainder is scheduling, tensor building and sampling.
"""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.model.dtypes import DTYPES
from tandem.wire.request_params import SamplingParams


def run_batch(
    engine: ColocatedEngine, batch: int, prompt_tokens: int, output_tokens: int, seed: int, temperature: float
) -> dict[str, Any]:
    rng = random.Random(seed)
    vocab = engine.model_config.vocab_size
    sampling = SamplingParams(
        max_tokens=output_tokens, ignore_eos=True, temperature=temperature, top_p=0.95 if temperature else 1.0
    )
    for _ in range(batch):
        engine.add_request([rng.randrange(vocab) for _ in range(prompt_tokens)], sampling)
    scheduler, runner = engine.scheduler, engine.runner
    queried, hit = scheduler.kv_cache.num_queried_tokens, scheduler.kv_cache.num_hit_tokens
    decode_step_s = decode_forward_s = decode_sample_s = 0.0
    decode_steps = 0
    start = time.perf_counter()
    while scheduler.has_unfinished_requests():
        t0 = time.perf_counter()
        forward_before, sample_before = runner.stats.forward_s, runner.stats.sample_s
        plan = scheduler.schedule()
        tokens = runner.run(plan)
        scheduler.update(plan, tokens)
        if plan.chunks and all(len(c.token_ids) == 1 for c in plan.chunks):
            decode_steps += 1
            decode_step_s += time.perf_counter() - t0
            decode_forward_s += runner.stats.forward_s - forward_before
            decode_sample_s += runner.stats.sample_s - sample_before
    elapsed = time.perf_counter() - start
    queried = scheduler.kv_cache.num_queried_tokens - queried
    hit = scheduler.kv_cache.num_hit_tokens - hit
    return {
        "batch": batch,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cache_hit_share": round(hit / queried, 4) if queried else 0.0,
        "elapsed_s": round(elapsed, 4),
        "output_tokens_per_s": round(batch * output_tokens / elapsed, 1),
        "total_tokens_per_s": round(batch * (prompt_tokens + output_tokens) / elapsed, 1),
        "decode_steps": decode_steps,
        "decode_step_ms": round(1000 * decode_step_s / max(decode_steps, 1), 3),
        "decode_forward_ms": round(1000 * decode_forward_s / max(decode_steps, 1), 3),
        "decode_outside_forward_share": round(1 - decode_forward_s / decode_step_s, 4)
        if decode_step_s
        else None,
        "decode_sampling_share": round(decode_sample_s / decode_step_s, 4) if decode_step_s else None,
    }


def run_engine_bench(
    model_dir: Path,
    dtype: str = "float32",
    prompt_tokens: int = 64,
    output_tokens: int = 64,
    batch_sizes: list[int] | None = None,
    temperature: float = 0.0,
) -> dict[str, Any]:
    sizes = batch_sizes or [1, 32]
    engine = ColocatedEngine.from_model_dir(
        model_dir,
        DTYPES[dtype],
        EngineConfig(
            max_num_seqs=max(sizes),
            max_num_batched_tokens=max(512, prompt_tokens),
            enable_prefix_caching=False,
        ),
    )
    run_batch(engine, 2, prompt_tokens, 4, seed=99, temperature=temperature)  # warm-up
    results = [run_batch(engine, b, prompt_tokens, output_tokens, b, temperature) for b in sizes]
    return {
        "model": str(model_dir),
        "dtype": dtype,
        "kernels": engine.model.ops.name,
        "sampling": f"temperature {temperature}, top_p 0.95" if temperature else "greedy",
        "runs": results,
    }
