"""``tandem serve --autoscale`` on this machine: a real Prometheus (started by the server)
scrapes the deployment and the controller's autoscaler acts on what it reads. The test drives
the ticks itself (the topology's interval is an hour) so that each decision meets a known load:
a burst of long prompts adds a prefill group, many concurrent long generations add a decode
group, and idle, both pools drain back to one group. Every request ends with the reference
tokens; afterwards every page is free. (On 2 cores a new group adds no capacity: what is checked
is the decisions and the mechanics.)"""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch

from tandem.client.grpc_client import ClientOptions, status
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import AutoscalingSpec, PoolBounds, PoolSpec, Topology
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.wire.autoscaler_decision import Decision
from tandem.wire.request_params import SamplingParams
from tandem.wire.stream_summary import StreamSummary
from tests.integration.prometheus_server import Prometheus

PAGE = 16
MAX_ROUNDS = 8  # rounds of decode load at most before the decode group must have been added


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[Server]:
    prefill = PoolSpec(dep=2, page_size=PAGE, num_pages=128)
    decode = PoolSpec(dep=2, page_size=PAGE, num_pages=48)  # 768 tokens a rank: long generations fill it
    autoscaling = AutoscalingSpec(
        prefill=PoolBounds(min_groups=1, max_groups=2),
        decode=PoolBounds(min_groups=1, max_groups=2),
        rank_budget=8,
        ttft_slo_s=0.05,
        itl_slo_s=10.0,  # decode scales on its KV usage here
        prefill_queue_target_s=100.0,
        decode_queue_target_s=100.0,
        kv_usage_target=0.5,
        interval_s=3600.0,  # the test ticks
        window="15s",
        upscale_ticks=2,
        downscale_ticks=2,
        settle_ticks=0,
    )
    topology = Topology.preset("local").model_copy(
        update={"prefill": prefill, "decode": decode, "autoscaling": autoscaling}
    )
    options = ServeOptions(
        topology, tiny_dir, port=0, dtype="float64", metrics_port=0, autoscale=True, scrape_interval_s=0.5
    )
    served = Server(options)
    try:
        served.start()
        yield served
    finally:
        served.stop()
        ray.shutdown()


def _tick(server: Server) -> dict[str, Decision]:
    time.sleep(1.5)  # a scrape or two since the last tick
    decisions = ray.get(server.controller.autoscaler_tick.remote(), timeout=300)
    return {d.pool: d for d in decisions}


def _groups(server: Server, role: str) -> list[str]:
    view = ray.get(server.controller.routing_view.remote())
    return sorted(g.group_id for g in view.groups if g.role.value == role and g.state == "ready")


def _run(
    server: Server, prompts: list[list[int]], sampling: SamplingParams, out: list[StreamSummary]
) -> None:
    out.extend(server.generate(prompts, [sampling] * len(prompts), timeout_s=600))


def _reference(tiny: Path, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
    engine = ColocatedEngine.from_model_dir(tiny, torch.float64, EngineConfig(page_size=PAGE, num_pages=1024))
    return [o.token_ids for o in engine.generate(prompts, [sampling] * len(prompts))]


def test_load_adds_groups_and_idle_drains_them(server: Server, tiny_dir: Path) -> None:
    rng = random.Random(5)
    assert _groups(server, "prefill") == ["prefill0"] and _groups(server, "decode") == ["decode0"]

    # a burst of long prompts: time to first token breaks its SLO, the decode pool stays calm
    burst = [[rng.randrange(256) for _ in range(500)] for _ in range(12)]
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    done: list[StreamSummary] = []
    _run(server, burst, one, done)
    first = _tick(server)
    assert (first["prefill"].action, first["prefill"].rule) == ("hold", "slo 1/2"), first
    second = _tick(server)
    assert (second["prefill"].action, second["prefill"].rule) == ("add", "slo"), second
    assert second["decode"].action == "hold"
    assert _groups(server, "prefill") == ["prefill0", "prefill1"]

    # many concurrent long generations: the decode ranks' KV fills, a decode group is added.
    # The load is kept up, round after round, until the decision comes (or MAX_ROUNDS): how
    # long one round lasts depends on the machine, and the rule wants two ticks in a row
    long = SamplingParams(max_tokens=120, ignore_eos=True)
    generations = [[rng.randrange(256) for _ in range(20)] for _ in range(16)]
    generated: list[StreamSummary] = []
    enough = threading.Event()

    def keep_loading() -> None:
        for _ in range(MAX_ROUNDS):
            _run(server, generations, long, generated)
            if enough.is_set():
                return

    worker = threading.Thread(target=keep_loading)
    worker.start()
    decisions = []
    while not any(d["decode"].action == "add" for d in decisions) and worker.is_alive():
        decisions.append(_tick(server))
    enough.set()
    worker.join(timeout=600)
    added = [d["decode"] for d in decisions if d["decode"].action == "add"]
    assert added and added[0].rule == "kv", [d["decode"].rule for d in decisions]
    assert _groups(server, "decode") == ["decode0", "decode1"]
    assert all(d["prefill"].action != "add" for d in decisions)  # prefill is at its max_groups

    # every request ended with the reference tokens
    assert [s.error for s in done + generated] == [None] * (len(burst) + len(generated))
    assert [s.token_ids for s in done] == _reference(tiny_dir, burst, one)
    rounds, left = divmod(len(generated), len(generations))
    assert rounds >= 1 and left == 0
    assert [s.token_ids for s in generated] == _reference(tiny_dir, generations, long) * rounds

    # idle: once the window holds no traffic, both pools drain back to their minimum
    deadline = time.monotonic() + 240
    while _groups(server, "prefill") != ["prefill0"] or _groups(server, "decode") != ["decode0"]:
        assert time.monotonic() < deadline, _tick(server)
        ticked = _tick(server)
        assert all(d.action != "add" for d in ticked.values()), ticked
    ray.get(server.controller.check_integrity.remote())
    stats = ray.get(server.controller.stats.remote())
    assert all(s.free_pages == s.total_pages for s in stats), stats
    # the decisions are kept for ClusterStatus and counted in the controller's metrics
    reply = asyncio.run(status(ClientOptions(f"127.0.0.1:{server.port}")))
    kept = list(reply.autoscaler_decisions)
    assert kept and "drain" in {d.action for d in kept}
    assert all(json.loads(d.inputs_json)["ready_groups"] == d.ready_groups for d in kept)
    assert server.prometheus is not None
    metrics = Prometheus(server.prometheus.url)
    metrics.wait_for('sum(tandem_autoscaler_decisions_total{action="add"})', 2)
    metrics.wait_for('sum(tandem_autoscaler_decisions_total{action="drain"})', 2)
    metrics.wait_for("sum(tandem_autoscaler_desired_groups)", 2)
