"""DeepSeek-V4 on the disaggregated cluster when things go wrong: a decode pool too small for its
requests preempts them (each recomputed through a new prefill, its state taken on again from
the slot that transfer filled), a rank killed in a DEP2 decode group mid-stream loses no stream
of its own or of its peer (each resumes on the rebuilt group from the tokens already streamed),
and a prefill rank killed with requests in flight to it leaves no reserved page or state slot
behind (each is prefilled again on the rank left). Every stream ends with the tokens of an
undisturbed colocated run, and every page and state slot is free at the end
(``check_integrity``)."""

from __future__ import annotations

import dataclasses
import random
import threading
import time
from pathlib import Path

import pytest
import ray
import torch

from tandem.cluster.pools import Cluster
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import PoolSpec, SpeculativeSpec, Topology
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.wire.messages import RankId, RankRequest, RequestResult
from tandem.wire.request_params import SamplingParams
from tandem.wire.stream_summary import StreamSummary
from tests.hf_v4_reference import write_tiny_v4

PAGE = 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, ray_started: None) -> Path:
    directory = tmp_path_factory.mktemp("v4faults") / "model"
    write_tiny_v4(directory, seed=3, index_topk=3, num_nextn_predict_layers=1)  # MTP: loaded when drafting
    return directory


def _serve(
    model_dir: Path,
    prefill: PoolSpec,
    decode: PoolSpec,
    health_interval_s: float = 0.5,
    speculative: SpeculativeSpec | None = None,
) -> Server:
    update = {"prefill": prefill, "decode": decode, "speculative": speculative or SpeculativeSpec()}
    topology = Topology.preset("local").model_copy(update=update)
    options = ServeOptions(topology, model_dir, port=0, dtype="float64", health_interval_s=health_interval_s)
    server = Server(options)
    server.start()
    return server


def _expected(model_dir: Path, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    engine = ColocatedEngine.from_model_dir(
        model_dir, torch.float64, EngineConfig(page_size=PAGE, num_pages=512)
    )
    return [o.token_ids for o in engine.generate([p for p, _ in requests], [s for _, s in requests])]


def _all_free(server: Server) -> None:
    ray.get(server.controller.check_integrity.remote())
    for stats in ray.get(server.controller.stats.remote()):
        assert (stats.sends_in_flight, stats.receives_in_flight) == (0, 0), stats
        if stats.role.value == "decode":
            assert stats.free_pages == stats.total_pages, stats


def test_a_decode_pool_too_small_preempts_and_every_request_gets_its_tokens(model_dir: Path) -> None:
    """Eight pages of 16 tokens a decode rank for eight requests of up to 100 tokens each."""
    server = _serve(
        model_dir,
        PoolSpec(dep=1, page_size=PAGE, num_pages=120, max_num_seqs=8),
        PoolSpec(dep=1, page_size=PAGE, num_pages=8, max_num_seqs=8),
    )
    rng = random.Random(4)
    requests = [
        (
            [rng.randrange(3, 256) for _ in range(rng.randrange(20, 60))],
            SamplingParams(max_tokens=40, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i),
        )
        for i in range(8)
    ]
    try:
        done = server.generate([p for p, _ in requests], [s for _, s in requests])
        assert [d.error for d in done] == [None] * len(requests)
        assert [d.token_ids for d in done] == _expected(model_dir, requests)
        decode = [s for s in ray.get(server.controller.stats.remote()) if s.role.value == "decode"]
        assert sum(s.preemptions for s in decode) > 0, decode
        _all_free(server)
    finally:
        server.stop()


def test_a_rank_killed_in_a_dep2_decode_group_loses_no_stream(model_dir: Path) -> None:
    """The group drafts with MTP (K = 2): each stream resumes through a new prefill, whose MTP
    state crosses again, and verifies drafts on the rebuilt group."""
    server = _serve(
        model_dir,
        PoolSpec(dep=1, page_size=PAGE, num_pages=120),
        PoolSpec(dep=2, page_size=PAGE, num_pages=120),
        health_interval_s=30.0,
        speculative=SpeculativeSpec(tokens=2, drafter="mtp"),
    )
    rng = random.Random(2)
    requests = [
        (
            [rng.randrange(3, 256) for _ in range(rng.randrange(5, 40))],
            SamplingParams(max_tokens=300, ignore_eos=True, temperature=1.0 if i % 2 else 0.0),
        )
        for i in range(4)
    ]
    try:
        done: list[StreamSummary] = []
        prompts, samplings = [p for p, _ in requests], [s for _, s in requests]
        thread = threading.Thread(target=lambda: done.extend(server.generate(prompts, samplings)))
        thread.start()
        deadline = time.monotonic() + 60
        while True:  # both ranks of the group stream
            decode = [s for s in ray.get(server.controller.stats.remote()) if s.role.value == "decode"]
            if len(decode) == 2 and all(s.running for s in decode):
                break
            assert time.monotonic() < deadline and thread.is_alive(), decode
            time.sleep(0.05)
        view = ray.get(server.controller.routing_view.remote())
        ray.kill(view.decode[RankId("decode0", 0)])
        thread.join(timeout=400)
        assert [d.error for d in done] == [None] * len(requests)
        assert all(d.bill.migrations == 1 for d in done)  # the peer's streams moved too
        assert sum(d.bill.speculation.draft_tokens for d in done) > 0
        replayed = [
            (p, dataclasses.replace(s, seed=d.bill.seed)) for (p, s), d in zip(requests, done, strict=True)
        ]
        assert [d.token_ids for d in done] == _expected(model_dir, replayed)
        deadline = time.monotonic() + 120  # the killed group is rebuilt; then every page is free
        while not all(s.startswith("ready") for s in ray.get(server.controller.status.remote()).values()):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        _all_free(server)
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("preset", "drafts"), [("dep16-dep2", 0), ("dep16-dep2", 3), ("9xdep2-1xdep16", 0)], ids=str
)
def test_the_reference_topologies_give_the_colocated_tokens(
    model_dir: Path, preset: str, drafts: int
) -> None:
    """The topologies V4 is served on: a DEP16 prefill group writing into DEP2 decode ranks (also
    with MTP drafts, K = 3: sixteen prefill ranks run the MTP layer in step, its state crossing
    with each request's), and nine DEP2 prefill groups writing into a DEP16 decode group (each
    rank of which holds less than one of the tiny model's eight experts' worth of work)."""
    t = Topology.preset(preset)
    prefill = PoolSpec(groups=t.prefill.groups, dep=t.prefill.dep, page_size=PAGE, num_pages=60)
    decode = PoolSpec(groups=t.decode.groups, dep=t.decode.dep, page_size=PAGE, num_pages=60)
    spec = SpeculativeSpec(tokens=drafts, drafter="mtp") if drafts else None
    server = _serve(model_dir, prefill, decode, speculative=spec)
    rng = random.Random(5)
    requests = [
        (
            [rng.randrange(3, 256) for _ in range(rng.randrange(5, 70))],
            SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i),
        )
        for i in range(4)
    ]
    try:
        done = server.generate([p for p, _ in requests], [s for _, s in requests])
        assert [d.error for d in done] == [None] * len(requests)
        assert [d.token_ids for d in done] == _expected(model_dir, requests)
        if drafts:
            assert sum(d.bill.speculation.draft_tokens for d in done) > 0
        _all_free(server)
    finally:
        server.stop()


def test_a_prefill_rank_killed_mid_flight_leaves_no_v4_slot_and_its_requests_complete_elsewhere(
    model_dir: Path,
) -> None:
    """Six V4 requests sent to one of two prefill ranks, killed as they arrive: the decode rank's
    receives from it fail once the controller fences it, each frees the pages and the state slot
    it reserved, and the request is prefilled again on the rank left, with the colocated
    engine's tokens."""
    t = Topology.preset("local").model_copy(
        update={
            "prefill": PoolSpec(groups=2, dep=1, page_size=PAGE, num_pages=120),
            "decode": PoolSpec(groups=1, dep=1, page_size=PAGE, num_pages=120),
        }
    )
    cluster = Cluster(t, str(model_dir), "float64")
    cluster.start()
    cluster.check_integrity()  # the decode rank has the membership and its connections
    decode = cluster.decode[0]
    victim = RankId("prefill0", 0)
    rng = random.Random(5)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    requests = [([rng.randrange(3, 256) for _ in range(rng.randrange(120, 180))], greedy) for _ in range(6)]
    try:
        for i, (prompt, sampling) in enumerate(requests):
            decode.submit(0, [RankRequest(f"k{i}", tuple(prompt), sampling, prefill_rank=victim)])
        ray.kill(cluster.prefill[0].actors[victim])
        start = time.monotonic()
        done: dict[str, RequestResult] = {}
        while len(done) < len(requests) and time.monotonic() - start < 60:
            cluster.watch()
            done |= {r.request_id: r for r in decode.poll(wait_s=0.2)}
        assert len(done) == len(requests), sorted(done)
        results = [done[f"k{i}"] for i in range(len(requests))]
        assert all(r.error is None for r in results), [r.error for r in results]
        assert [list(r.token_ids) for r in results] == _expected(model_dir, requests)
        lost = [r for r in results if len(r.bill.attempts) > 1]
        assert lost, "no request was in flight on the killed rank"
        assert all(r.prefill_rank == RankId("prefill1", 0) for r in lost)
        assert cluster.heal() == ["prefill0"]
        cluster.check_integrity()  # a state slot held with no transfer under way fails it
        for s in cluster.stats():
            assert s.free_pages == s.total_pages and (s.sends_in_flight, s.receives_in_flight) == (0, 0), s
    finally:
        cluster.stop()
