"""``tandem generate --dep N``: the colocated engine as one DEPn group of Ray actors."""

from __future__ import annotations

from pathlib import Path

from tandem.cluster.dep_group import DEPGroup, DEPGroupConfig
from tandem.cluster.ray_bootstrap import init_ray
from tandem.engine.colocated import EngineConfig
from tandem.engine.dep_rank import FinishedRequest, RankRequest
from tandem.engine.request import SamplingParams


def generate_on_dep_group(
    model_dir: Path,
    prompts: list[list[int]],
    sampling: list[SamplingParams],
    dep: int,
    dtype: str = "float32",
    engine: EngineConfig | None = None,
    address: str | None = None,
    timeout_s: float = 600.0,
) -> list[FinishedRequest]:
    """Spread the prompts over the ranks (prompt ``i`` to rank ``i % dep``), run them
    concurrently, and return the results in input order."""
    init_ray(address)
    group = DEPGroup(DEPGroupConfig("generate", str(model_dir), dep, dtype, engine or EngineConfig()))
    group.start()
    try:
        for rank in range(dep):
            batch = [
                RankRequest(f"req-{i}", p, s)
                for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))
                if i % dep == rank
            ]
            if batch:
                group.submit(rank, batch)
        done = {r.request_id: r for r in group.run_to_completion(timeout_s)}
    finally:
        group.stop()
    return [done[f"req-{i}"] for i in range(len(prompts))]
