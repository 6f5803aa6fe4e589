"""``tandem generate --preset NAME`` (or ``--topology FILE``): start a disaggregated cluster, run
the prompts through it, stop it, and report each output with its placement and bill."""

from __future__ import annotations

from typing import Any

import ray

from tandem.cluster.cluster import CONTROLLER_NAME, Controller
from tandem.cluster.ray_bootstrap import init_ray
from tandem.cluster.topology import Topology
from tandem.decode.worker import DecodeResult
from tandem.engine.dep_rank import RankRequest
from tandem.engine.request import SamplingParams


def _where(rank_name: str | None) -> dict[str, Any] | None:
    if not rank_name:
        return None
    group, _, rank = rank_name.rpartition("-r")
    return {"group": group, "rank": int(rank)}


def result_record(result: DecodeResult) -> dict[str, Any]:
    bill = result.bill
    return {
        "placement": {"prefill": _where(result.prefill_rank), "decode": _where(result.decode_rank)},
        "bill": {
            "prompt_tokens": bill.prompt_tokens,
            "cached_tokens": bill.cached_tokens,
            "new_prompt_tokens": bill.new_prompt_tokens,
            "output_tokens": bill.output_tokens,
            "kv_bytes": bill.kv_bytes,
            "kv_transfer_s": round(bill.kv_transfer_s, 6),
            "kv_transfer_exposed_s": round(bill.kv_transfer_exposed_s, 6),
            "prefill_queue_s": round(bill.prefill_queue_s, 6),
            "prefill_compute_s": round(bill.prefill_compute_s, 6),
            "ttft_s": round(bill.ttft_s, 6),
            "token_times_s": [round(t, 6) for t in bill.token_times_s],
            "e2e_s": round(bill.e2e_s, 6),
        },
    }


def generate_on_cluster(
    topology: Topology,
    model_dir: str,
    prompts: list[list[int]],
    sampling: list[SamplingParams],
    dtype: str = "float32",
    address: str | None = None,
    timeout_s: float = 600.0,
) -> list[DecodeResult]:
    init_ray(address)
    controller = Controller.options(name=CONTROLLER_NAME).remote(topology, model_dir, dtype)  # type: ignore[attr-defined]
    try:
        ray.get(controller.start.remote())
        pairs = enumerate(zip(prompts, sampling, strict=True))
        requests = [RankRequest(f"req-{i}", p, s) for i, (p, s) in pairs]
        ray.get(controller.submit.remote(requests))
        ids = [r.request_id for r in requests]
        done: dict[str, DecodeResult] = ray.get(controller.results.remote(ids, timeout_s))
        missing = [i for i in ids if i not in done]
        if missing:
            raise TimeoutError(f"{len(missing)} requests unfinished after {timeout_s:.0f}s")
    finally:
        ray.get(controller.stop.remote())
        ray.kill(controller)
    return [done[f"req-{i}"] for i in range(len(prompts))]
