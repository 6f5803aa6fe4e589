"""Time to first token and inter-token latency: disaggregated (layer-wise and whole-request KV
transfer) against the colocated engine, on the same machine, at several concurrencies.

Every configuration serves the same requests (random prompts, greedy, ``ignore_eos``): at
concurrency ``c``, rounds of ``c`` requests submitted together until ``requests`` have run.
TTFT is from submission to the first token (at the frontend for the cluster); ITL is the mean gap
between a request's tokens; the exposed share is the KV transfer's exposed time (last layer
computed -> KV usable on the decode rank) over TTFT.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time
from pathlib import Path
from typing import Any

from tandem.bench.random_prompts import RandomPrompts
from tandem.cluster.ray_bootstrap import init_ray
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import Topology
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.model.dtypes import DTYPES
from tandem.wire.request_params import SamplingParams


def _summary(ttft: list[float], itl: list[float], exposed: list[float] | None = None) -> dict[str, Any]:
    out = {
        "ttft_ms_mean": round(1000 * statistics.mean(ttft), 2),
        "ttft_ms_p50": round(1000 * statistics.median(ttft), 2),
        "itl_ms_mean": round(1000 * statistics.mean(itl), 2) if itl else None,
    }
    if exposed is not None:
        out["kv_exposed_share_of_ttft"] = round(
            statistics.mean(e / t for e, t in zip(exposed, ttft, strict=True)), 4
        )
    return out


def _itl(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times)]


def _colocated(
    model_dir: Path, dtype: str, rounds: list[list[list[int]]], sampling: SamplingParams
) -> dict[str, Any]:
    engine = ColocatedEngine.from_model_dir(model_dir, DTYPES[dtype], EngineConfig())
    ttft: list[float] = []
    itl: list[float] = []
    for prompts in rounds:
        start = time.monotonic()
        ids = [engine.add_request(p, sampling) for p in prompts]
        seen = dict.fromkeys(ids, 0)
        times: dict[str, list[float]] = {i: [] for i in ids}
        while engine.scheduler.has_unfinished_requests():
            finished = {r.request_id: r for r in engine.step()}
            now = time.monotonic() - start
            for i in ids:
                request = finished.get(i) or engine.scheduler.get_request(i)
                count = len(request.output_token_ids) if request is not None else seen[i]
                times[i] += [now] * (count - seen[i])
                seen[i] = count
        for i in ids:
            ttft.append(times[i][0])
            itl += _itl(times[i])
    return _summary(ttft, itl)


def _disaggregated(
    model_dir: Path, dtype: str, topology: Topology, rounds: list[list[list[int]]], sampling: SamplingParams
) -> dict[str, Any]:
    """The rounds through a served cluster's frontend, the path every gRPC request takes."""
    # a deployment of its own, beside any that serves (or is still stopping) on the same cluster
    name = f"disagg-bench-{os.getpid()}-{time.monotonic_ns()}"
    server = Server(ServeOptions(topology, model_dir, port=0, dtype=dtype, deployment=name))
    server.start()
    ttft: list[float] = []
    itl: list[float] = []
    exposed: list[float] = []
    try:
        for prompts in rounds:
            for summary in server.generate(prompts, [sampling] * len(prompts)):
                if summary.error:
                    raise RuntimeError(summary.error)
                ttft.append(summary.ttft_s)
                itl += list(summary.token_gaps_s)
                exposed.append(summary.bill.kv_transfer_exposed_s)
    finally:
        server.stop()
    return _summary(ttft, itl, exposed)


def run_disagg_bench(
    model_dir: Path,
    preset: str = "local",
    concurrencies: list[int] | None = None,
    requests: int = 16,
    prompt_tokens: int = 128,
    output_tokens: int = 16,
    dtype: str = "float32",
    address: str | None = None,
) -> dict[str, Any]:
    init_ray(address)
    random_prompts = RandomPrompts(model_dir)
    sampling = SamplingParams(max_tokens=output_tokens, ignore_eos=True)
    base = Topology.preset(preset)
    runs = []
    for c in concurrencies or [1, 16]:
        prompts = random_prompts.make(max(requests, c), prompt_tokens)
        rounds = [prompts[i : i + c] for i in range(0, len(prompts), c)]
        row: dict[str, Any] = {"concurrency": c, "requests": len(prompts)}
        row["colocated"] = _colocated(model_dir, dtype, rounds, sampling)
        for mode in ("layerwise", "whole"):
            topology = base.model_copy(update={"kv_transfer": mode})
            row[f"disaggregated_{mode}"] = _disaggregated(model_dir, dtype, topology, rounds, sampling)
        runs.append(row)
    return {
        "model": str(model_dir),
        "preset": preset,
        "dtype": dtype,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "prompts": "random, none shares a prefix",
        "runs": runs,
    }
