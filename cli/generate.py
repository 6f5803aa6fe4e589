"""``tandem generate`` beyond one process: on one colocated DEP group (``--dep N``), or on a
disaggregated cluster (``--preset``/``--topology``) through the frontend that serves gRPC, so
these prompts take the path every served request takes (router, decode rank, prefill rank)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from tandem.cluster.group import GroupConfig, RankGroup
from tandem.cluster.ray_bootstrap import init_ray
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import Topology
from tandem.engine.colocated_role import ColocatedRole
from tandem.engine.engine_config import EngineConfig
from tandem.wire.messages import RankId, RankRequest, RequestResult
from tandem.wire.request_params import SamplingParams
from tandem.wire.stream_summary import StreamSummary


def generate_on_dep_group(
    model_dir: Path,
    prompts: list[list[int]],
    sampling: list[SamplingParams],
    dep: int,
    dtype: str = "float32",
    engine: EngineConfig | None = None,
    address: str | None = None,
    timeout_s: float = 600.0,
) -> list[RequestResult]:
    """Spread the prompts over the ranks (prompt ``i`` to rank ``i % dep``), run them
    concurrently, and return the results in input order."""
    init_ray(address)
    role = ColocatedRole(engine or EngineConfig())
    group = RankGroup(GroupConfig("generate", str(model_dir), dep, role, dtype))
    group.start()
    try:
        for rank in range(dep):
            batch = [
                RankRequest(f"req-{i}", tuple(p), s)
                for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))
                if i % dep == rank
            ]
            if batch:
                group.submit(rank, batch)
        done = {r.request_id: r for r in group.run_to_completion(timeout_s)}
    finally:
        group.stop()
    return [done[f"req-{i}"] for i in range(len(prompts))]


def generate_on_cluster(
    topology: Topology,
    model_dir: str,
    prompts: list[list[int]],
    sampling: list[SamplingParams],
    dtype: str = "float32",
    address: str | None = None,
) -> list[StreamSummary]:
    """Start the cluster and its frontend (gRPC on a loopback port of the OS's choosing), run
    the prompts concurrently through the frontend, stop everything; the summaries in order."""
    # a deployment of its own, beside any that serves on the same cluster
    name = f"generate-{os.getpid()}"
    server = Server(
        ServeOptions(topology, Path(model_dir), port=0, dtype=dtype, address=address, deployment=name)
    )
    server.start()
    try:
        return server.generate(prompts, sampling)
    finally:
        server.stop()


def _where(rank: RankId | None) -> dict[str, Any] | None:
    return {"group": rank.group_id, "rank": rank.rank} if rank is not None else None


def summary_record(summary: StreamSummary) -> dict[str, Any]:
    """A summary's placement and bill, as ``generate --json`` prints them."""
    bill = summary.bill
    return {
        "placement": {"prefill": _where(summary.prefill_rank), "decode": _where(summary.decode_rank)},
        "bill": {
            "prompt_tokens": bill.prompt_tokens,
            "cached_tokens": bill.cached_tokens,
            "cached_tokens_by_tier": bill.cached_tokens_by_tier.as_dict(),
            "new_prompt_tokens": bill.new_prompt_tokens,
            "output_tokens": bill.output_tokens,
            "kv_bytes": bill.kv_bytes,
            "attempts": len(bill.attempts),
            "preemptions": bill.preemptions,
            "migrations": bill.migrations,
            "latency": {part: round(s, 6) for part, s in summary.latency_parts().items()}
            | {
                "prefill_queue": round(bill.prefill_queue_s, 6),
                "prefill_compute": round(bill.prefill_compute_s, 6),
                "kv_transfer": round(bill.kv_transfer_s, 6),
                "kv_transfer_exposed": round(bill.kv_transfer_exposed_s, 6),
                "ttft": round(summary.ttft_s, 6),
                "e2e": round(summary.e2e_s, 6),
            },
            "token_times_s": [round(t, 6) for t in bill.token_times_s],
        },
    }
