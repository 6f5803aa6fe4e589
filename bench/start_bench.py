"""How fast a deployment serves: ``tandem bench start``.

For each preset, the deployment is started on an embedded Ray in this process three times, in
one run on one machine: its groups one after another with each KV connection made at its first
transfer (``start_concurrency: 1``, ``kv_preconnect: false``: how a deployment started before),
side by side, and side by side with every rank's transport connected to the other role's when
the membership changes (the defaults). Each start reports:

- **serve to SERVING**: ``Server.start`` (the controller, every group placed, its ranks'
  processes up, the model loaded, the ranks' rendezvous, the frontend's first view) until the
  frontend answers SERVING, on this process's clock. Ray's own start is timed apart (``ray``).
- **first requests**: ``--requests`` requests one after another, each a prompt of
  ``--prompt-tokens`` random token ids sharing no prefix with another (no cache helps), and their
  time to first token at the frontend. The first request is the first transfer between its two
  ranks (NIXL wire-up) and the first step of each (lazy allocations): the first against the
  median of the others is what the start leaves to the first user. ``kv_wait`` is the decode
  rank's wait for the KV (the prefill's compute and the transfer), where a wire-up shows.
- **add a group**: ``add_group`` of one more prefill group, from the call (the autoscaler's
  decision) until it takes work, then until the first request it computed returned (that
  figure includes a 0.5 s pause after the add, for the frontend to read the new view).

Left out: a real model's load time (the demo model loads in well under a second; a DeepSeek-V3
checkpoint's load dominates a real start), GPU warm-up (CUDA graphs, Triton compiles) and a
multi-node placement (a cluster's nodes start their processes in parallel; here two cores do).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import ray

from tandem.bench.random_prompts import RandomPrompts
from tandem.client.output import emit
from tandem.cluster.ray_bootstrap import init_ray, shutdown_ray
from tandem.cluster.serve import DEFAULT_DEPLOYMENT, ServeOptions, Server, demo_model_dir
from tandem.cluster.topology import Topology, TopologyError
from tandem.wire.request_params import InvalidRequestError, SamplingParams

# (start_concurrency, kv_preconnect): how groups started before, then each change on its own
MODES = {
    "one after another, connect at first transfer": (1, False),
    "side by side, connect at first transfer": (None, False),
    "side by side, preconnected": (None, True),
}


def _requests(server: Server, prompts: list[list[int]], max_tokens: int) -> list[dict[str, Any]]:
    out = []
    for i, prompt in enumerate(prompts):
        summary = server.generate([prompt], [SamplingParams(max_tokens=max_tokens, ignore_eos=True)])[0]
        if summary.error is not None:
            raise RuntimeError(f"request {i} failed: {summary.error}")
        parts = summary.latency_parts()
        out.append(
            {
                "ttft_s": summary.ttft_s,
                "kv_wait_s": parts["kv_wait"],
                "prefill_group": summary.prefill_rank.group_id if summary.prefill_rank else None,
            }
        )
    return out


def _add_group(server: Server, prompts: RandomPrompts, tokens: int, max_tokens: int) -> dict[str, Any]:
    """One more prefill group: call -> it takes work -> the first request it computed returned
    (requests one after another until the router sends one there, 20 at most)."""
    t0 = time.perf_counter()
    group = ray.get(server.controller.add_group.remote("prefill"))
    ready_s = time.perf_counter() - t0
    time.sleep(0.5)  # the frontend reads the controller's view every 0.2 s
    for _ in range(20):
        done = _requests(server, prompts.make(1, tokens), max_tokens)[0]
        if done["prefill_group"] == group:
            return {"group": group, "ready_s": ready_s, "first_served_s": time.perf_counter() - t0,
                    "first_ttft_s": done["ttft_s"]}  # fmt: skip
    return {"group": group, "ready_s": ready_s, "first_served_s": None, "first_ttft_s": None}


def run_one(
    topology: Topology, mode: str, model_dir: Path, requests: int, tokens: int, max_tokens: int
) -> dict[str, Any]:
    concurrency, preconnect = MODES[mode]
    configured = topology.model_copy(update={"start_concurrency": concurrency, "kv_preconnect": preconnect})
    t0 = time.perf_counter()
    init_ray(namespace=DEFAULT_DEPLOYMENT)
    ray_s = time.perf_counter() - t0
    try:
        server = Server(ServeOptions(configured, model_dir, port=0))
        t0 = time.perf_counter()
        server.start()
        serving_s = time.perf_counter() - t0
        try:
            prompts = RandomPrompts(model_dir, seed=1)
            first = _requests(server, prompts.make(requests, tokens), max_tokens)
            added = _add_group(server, prompts, tokens, max_tokens)
        finally:
            server.stop()
    finally:
        shutdown_ray()
    ttfts = [r["ttft_s"] for r in first]
    return {
        "preset": topology.name,
        "ranks": topology.ranks,
        "groups": topology.prefill.groups + topology.decode.groups,
        "mode": mode,
        "ray_s": ray_s,
        "serving_s": serving_s,
        "ttft_s": ttfts,
        "kv_wait_s": [r["kv_wait_s"] for r in first],
        "first_over_rest": ttfts[0] / statistics.median(ttfts[1:]) if len(ttfts) > 1 else None,
        "add_group": added,
    }


def run_start(
    presets: list[str], model_dir: Path, requests: int, tokens: int, max_tokens: int
) -> dict[str, Any]:
    topologies = []
    for name in presets:
        try:
            topologies.append(Topology.preset(name))
        except TopologyError as exc:
            raise InvalidRequestError("--preset", exc.message) from None
    runs = [run_one(t, mode, model_dir, requests, tokens, max_tokens) for t in topologies for mode in MODES]
    return {"requests": requests, "prompt_tokens": tokens, "max_tokens": max_tokens, "runs": runs}


def _first_over_rest(values: list[float]) -> str:
    if len(values) < 2:
        return "-"
    rest = statistics.median(values[1:])
    return f"{1e3 * values[0]:.0f} / {1e3 * rest:.0f} ms"


def format_start(result: dict[str, Any]) -> str:
    n = result["requests"]
    lines = [
        f"serve -> SERVING, then {n} requests of {result['prompt_tokens']} new prompt tokens one "
        f"after another (TTFT at the frontend), then one prefill group added",
        "| preset | ranks | start | serve -> SERVING | ratio | TTFT 1st | TTFT 10th | "
        "TTFT 1st / median rest | KV wait 1st / median rest | add: ready | add: first served |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    base: dict[str, float] = {}
    for r in result["runs"]:
        base.setdefault(r["preset"], r["serving_s"])
        ttft = r["ttft_s"]
        tenth = f"{1e3 * ttft[9]:.0f} ms" if len(ttft) >= 10 else "-"
        ratio = r["first_over_rest"]
        add = r["add_group"]
        served = add["first_served_s"]
        lines.append(
            f"| {r['preset']} | {r['ranks']} | {r['mode']} | {r['serving_s']:.1f} s | "
            f"{r['serving_s'] / base[r['preset']]:.2f} | {1e3 * ttft[0]:.0f} ms | {tenth} | "
            f"{'-' if ratio is None else f'{ratio:.2f}'} | {_first_over_rest(r['kv_wait_s'])} | "
            f"{add['ready_s']:.1f} s | "
            f"{'not routed there' if served is None else f'{served:.1f} s'} |"
        )
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset", action="append", default=None, help="topology preset, repeatable (default: local)"
    )
    parser.add_argument("--requests", type=int, default=10, help="requests after the start, one at a time")
    parser.add_argument("--prompt-tokens", type=int, default=512, help="new prompt tokens per request")
    parser.add_argument("--max-tokens", type=int, default=4, help="output tokens per request")
    parser.add_argument("--model", type=Path, default=None, help="model directory (default: the demo model)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run_start_command(args: argparse.Namespace) -> int:
    if args.requests < 1:
        raise InvalidRequestError("--requests", f"expected at least 1, got {args.requests}")
    if args.prompt_tokens < 1:
        raise InvalidRequestError("--prompt-tokens", f"expected at least 1, got {args.prompt_tokens}")
    if args.max_tokens < 1:
        raise InvalidRequestError("--max-tokens", f"expected at least 1, got {args.max_tokens}")
    model_dir = args.model or demo_model_dir()
    presets = args.preset or ["local"]
    result = run_start(presets, model_dir, args.requests, args.prompt_tokens, args.max_tokens)
    emit(json.dumps(result) if args.json else format_start(result))
    return 0
