"""Per-step time of DEP groups of several sizes on one model, with the all-to-all time apart.

Each rank gets the same load (``requests_per_rank`` requests of ``prompt_tokens`` random tokens,
``output_tokens`` generated, greedy), so the groups differ only in how many ranks step in
lockstep and exchange MoE rows. Times are each rank's own wall clock, averaged over ranks.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from tandem.bench.random_prompts import RandomPrompts
from tandem.cluster.group import GroupConfig, RankGroup
from tandem.cluster.ray_bootstrap import init_ray
from tandem.engine.colocated_role import ColocatedRole
from tandem.engine.engine_config import EngineConfig
from tandem.wire.messages import RankRequest
from tandem.wire.request_params import SamplingParams


def run_dep_bench(
    model_dir: Path,
    sizes: list[int],
    requests_per_rank: int = 4,
    prompt_tokens: int = 32,
    output_tokens: int = 32,
    dtype: str = "float32",
    address: str | None = None,
) -> dict[str, Any]:
    init_ray(address)
    random_prompts = RandomPrompts(model_dir)
    runs = []
    for size in sizes:
        role = ColocatedRole(EngineConfig(enable_prefix_caching=False))
        group = RankGroup(GroupConfig(f"bench-dep{size}", str(model_dir), size, role, dtype))
        group.start()
        try:
            sampling = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
            # taken before the first submit: a rank starts stepping as soon as its requests arrive
            before = group.stats()
            start = time.perf_counter()
            for rank in range(size):
                prompts = random_prompts.make(requests_per_rank, prompt_tokens)
                group.submit(
                    rank, [RankRequest(f"r{rank}-{i}", tuple(p), sampling) for i, p in enumerate(prompts)]
                )
            results = group.run_to_completion(timeout_s=600)
            elapsed = time.perf_counter() - start
            after = group.stats()
        finally:
            group.stop()
        errors = [r.error for r in results if r.error]
        if errors:
            raise RuntimeError(errors[0])
        pairs = list(zip(after, before, strict=True))
        steps = sum(a.loop.steps - b.loop.steps for a, b in pairs) / size
        step_s = sum(a.loop.step_s - b.loop.step_s for a, b in pairs) / size
        a2a_s = sum(a.all_to_all_s - b.all_to_all_s for a, b in pairs) / size
        agree_s = sum(a.loop.agree_s - b.loop.agree_s for a, b in pairs) / size
        runs.append({
            "dep": size,
            "requests": size * requests_per_rank,
            "steps": round(steps, 1),
            "step_ms": round(1000 * step_s / steps, 3),
            "all_to_all_ms_per_step": round(1000 * a2a_s / steps, 3),
            "all_to_all_share": round(a2a_s / step_s, 4),
            "agree_ms_per_step": round(1000 * agree_s / steps, 3),
            "output_tokens_per_s": round(size * requests_per_rank * output_tokens / elapsed, 1),
        })  # fmt: skip
    return {
        "model": str(model_dir),
        "dtype": dtype,
        "requests_per_rank": requests_per_rank,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "prefix_caching": False,
        "runs": runs,
    }
