"""A colocated pool behind the same frontend (real Ray, gRPC on loopback): one DEP2 group that
prefills and decodes, float64, pages of 8 tokens. Tokens equal the in-process colocated
engine's, the bill carries the rank's own prefill figures, the router follows the ranks' KV
events to a held prefix, and a cancelled stream frees its pages."""

from __future__ import annotations

import asyncio
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
import ray
import torch

from tandem.client.grpc_client import ClientOptions, Outcome, generate_all, request_message
from tandem.client.prompts import PromptSpec
from tandem.cluster.controller import Controller
from tandem.cluster.ray_bootstrap import init_ray, shutdown_ray
from tandem.cluster.topology import PoolSpec, Topology, TopologyError
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.frontend.actor import Frontend
from tandem.frontend.core import FRONTEND_NAME, FrontendConfig
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.protos import tandem_pb2, tandem_pb2_grpc
from tandem.wire.request_params import SamplingParams
from tandem.wire.routing_view import CONTROLLER_NAME

PAGE = 8


@dataclass
class Served:
    addr: str
    tiny: Path
    controller: Any
    frontend: Any


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    tiny = make_tiny_checkpoint(tmp_path_factory.mktemp("colocated") / "tiny", seed=0)
    init_ray()
    config = FrontendConfig(str(tiny), "tiny", port=0, cores=(0,))
    frontend = Frontend.options(name=FRONTEND_NAME).remote(config)  # type: ignore[attr-defined]
    controller = None
    try:
        addr = f"127.0.0.1:{ray.get(frontend.start.remote())}"
        pool = PoolSpec(dep=2, page_size=PAGE, num_pages=200)
        topology = Topology(name="colocated", colocated=pool, pin_cores_per_rank=1)
        controller = Controller.options(name=CONTROLLER_NAME).remote(topology, str(tiny), "float64")  # type: ignore[attr-defined]
        ray.get(controller.start.remote())
        assert ray.get(frontend.wait_ready.remote(60.0))
        yield Served(addr, tiny, controller, frontend)
    finally:
        ray.get(frontend.stop.remote())
        ray.kill(frontend)
        if controller is not None:
            ray.get(controller.stop.remote())
            ray.kill(controller)
        shutdown_ray()


def _generate(served: Served, specs: list[PromptSpec], concurrency: int) -> list[Outcome]:
    return asyncio.run(generate_all(ClientOptions(served.addr, timeout_s=120.0), specs, concurrency))


def _status(served: Served) -> tandem_pb2.ClusterStatusResponse:
    with grpc.insecure_channel(served.addr) as channel:
        request = tandem_pb2.ClusterStatusRequest(check_integrity=True)
        reply: tandem_pb2.ClusterStatusResponse = tandem_pb2_grpc.TandemStub(channel).ClusterStatus(
            request, timeout=30
        )
        return reply


def _wait_all_pages_free(served: Served, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        status = _status(served)
        ranks = [r for g in status.groups for r in g.ranks]
        settled = status.running_requests == 0 and all(
            r.free_pages == r.total_pages and r.running == 0 and r.queued == 0 for r in ranks
        )
        if settled or time.monotonic() > deadline:
            assert all(r.integrity == "ok" for r in ranks), [(r.name, r.integrity) for r in ranks]
            assert settled, status
            return
        time.sleep(0.1)


def test_a_topology_has_a_colocated_pool_or_prefill_and_decode_pools() -> None:
    preset = Topology.preset("colocated")
    assert (
        preset.describe() == "colocated: 2xDEP2 colocated" and preset.ranks == Topology.preset("local").ranks
    )
    with pytest.raises(ValueError, match="decode: a topology with a colocated pool has no decode pool"):
        Topology.model_validate({"colocated": {"dep": 2}, "decode": {"dep": 2}})
    with pytest.raises(ValueError, match="autoscaling: "):
        Topology.model_validate({"colocated": {}, "autoscaling": {}})
    with pytest.raises(TopologyError, match="no preset 'nope'"):
        Topology.preset("nope")


def test_streams_give_the_colocated_engines_tokens_with_the_ranks_bill(served: Served) -> None:
    rng = random.Random(5)
    specs = [
        PromptSpec(
            None,
            [rng.randrange(256) for _ in range(rng.randrange(3, 40))],
            SamplingParams(
                max_tokens=rng.randrange(4, 12), temperature=0.8 * (i % 2), seed=i, ignore_eos=True
            ),
        )
        for i in range(8)
    ]
    outcomes = _generate(served, specs, concurrency=8)
    engine = ColocatedEngine.from_model_dir(
        served.tiny, torch.float64, EngineConfig(page_size=PAGE, num_pages=512)
    )
    expected = [
        o.token_ids
        for o in engine.generate([list(s.token_ids or []) for s in specs], [s.sampling for s in specs])
    ]
    for outcome, tokens in zip(outcomes, expected, strict=True):
        summary = outcome.summary
        assert summary is not None and summary.error == "", summary
        assert list(summary.token_ids) == tokens
        assert [t for c in outcome.chunks for t in c.token_ids] == tokens
        placement, bill = summary.placement, summary.bill
        assert placement.decode_rank == placement.prefill_rank and placement.decode_rank.startswith(
            "colocated0-r"
        )
        assert bill.cached_tokens + bill.new_prompt_tokens == bill.prompt_tokens > 0
        assert bill.output_tokens == len(tokens) and bill.kv_bytes == 0
        (attempt,) = bill.attempts
        assert attempt.delivered and attempt.prefill_rank == placement.decode_rank
        lat = bill.latency
        assert lat.prefill_compute_s > 0 and lat.decode_s > 0 and lat.kv_transfer_s == 0
        assert 0 < lat.ttft_s <= lat.e2e_s
        assert lat.prefill_queue_s + lat.prefill_compute_s <= lat.rank_s
    _wait_all_pages_free(served)


def test_a_repeated_prefix_goes_back_to_the_rank_that_holds_it(served: Served) -> None:
    rng = random.Random(11)
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    for conversation in range(3):
        first = [rng.randrange(256) for _ in range(5 * PAGE + 3)]
        (a,) = _generate(served, [PromptSpec(None, first, sampling)], 1)
        assert a.summary is not None
        holder = a.summary.placement.prefill_rank
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the rank's KV events reach the router
            status = _status(served)
            if any(r.name == holder and r.indexed_blocks >= 5 for g in status.groups for r in g.ranks):
                break
            time.sleep(0.05)
        follow_up = first + list(a.summary.token_ids) + [rng.randrange(256) for _ in range(4)]
        (b,) = _generate(served, [PromptSpec(None, follow_up, sampling)], 1)
        assert b.summary is not None
        placement, bill = b.summary.placement, b.summary.bill
        assert placement.prefill_rank == placement.decode_rank == holder, conversation
        assert placement.route_branch == "cache_hit"
        assert placement.predicted_cached_tokens == bill.cached_tokens >= 5 * PAGE
    _wait_all_pages_free(served)


def test_a_cancelled_stream_frees_its_pages(served: Served) -> None:
    long = PromptSpec(None, list(range(30)), SamplingParams(max_tokens=1500, ignore_eos=True))

    async def cancel_midway() -> None:
        async with grpc.aio.insecure_channel(served.addr) as channel:
            call: Any = tandem_pb2_grpc.TandemStub(channel).Generate(request_message(long, "cancel-me"))
            seen = 0
            async for response in call:
                seen += response.HasField("chunk")
                if seen >= 3:
                    break
            assert _status(served).running_requests == 1
            call.cancel()

    asyncio.run(cancel_midway())
    _wait_all_pages_free(served)


def test_each_rank_runs_pinned_to_its_own_core(served: Served) -> None:
    view = ray.get(served.controller.routing_view.remote())
    (group,) = view.groups
    cores = os.cpu_count() or 1
    pinned = {r.rank: os.sched_getaffinity(p.pid) for r, p in zip(group.ranks, group.places, strict=True)}
    assert pinned == {0: {0}, 1: {1 % cores}}


def test_the_frontend_runs_pinned_to_its_cores_every_thread_of_it(served: Served) -> None:
    pid = ray.get(served.frontend.info.remote()).place.pid
    threads = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir(f"/proc/{pid}/task")}
    assert len(threads) > 1  # Ray's, gRPC's and the event loop's
    assert all(cores == {0} for cores in threads.values()), threads
