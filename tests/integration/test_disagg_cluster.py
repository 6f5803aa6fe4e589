"""The disaggregated cluster on Ray with real NIXL: each preset gives the colocated engine's
tokens (float64, greedy and seeded), prefixes are reused, a tiny decode pool leaks nothing, a
dying prefill rank never leaves a request hanging, and an FP8 checkpoint stays FP8 on every rank
and gives ``transformers``' tokens."""

from __future__ import annotations

import dataclasses
import json
import random
import time
from pathlib import Path

import pytest
import ray
import torch

from tandem.cluster.pools import Cluster
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import PoolSpec, Topology
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.dep import ExpertParallelDispatcher
from tandem.engine.engine_config import EngineConfig
from tandem.model.config import ModelConfig
from tandem.model.deepseek import DeepseekV3
from tandem.model.kernels.fp8 import FP8_DTYPE
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.wire.messages import RankId, RankRequest, RankStats, RequestResult
from tandem.wire.request_params import SamplingParams
from tandem.wire.stream_summary import StreamSummary
from tests.hf_reference import dequantised_hf_model, greedy_hf_tokens

PAGE = 8


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path, ray_started: None) -> Path:
    return tiny_dir


def _topology(preset: str, decode_pages: int = 96, kv_timeout_s: float = 30.0) -> Topology:
    t = Topology.preset(preset)
    prefill = PoolSpec(groups=t.prefill.groups, dep=t.prefill.dep, page_size=PAGE, num_pages=96)
    decode = PoolSpec(groups=t.decode.groups, dep=t.decode.dep, page_size=PAGE, num_pages=decode_pages)
    return t.model_copy(update={"prefill": prefill, "decode": decode, "kv_timeout_s": kv_timeout_s})


def _chats(seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Two waves of 12: the second repeats the first wave's long shared prefixes (system prompt
    and earlier turns), as multi-turn chats do. Odd requests sample with a seed."""
    rng = random.Random(seed)
    system = [rng.randrange(256) for _ in range(3 * PAGE)]
    first = [system + [rng.randrange(256) for _ in range(rng.randrange(1, 12))] for _ in range(12)]
    second = [p + [rng.randrange(256) for _ in range(rng.randrange(1, 8))] for p in first]
    return [
        (p, SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i))
        for i, p in enumerate(first + second)
    ]


def _expected(tiny: Path, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    engine = ColocatedEngine.from_model_dir(tiny, torch.float64, EngineConfig(page_size=PAGE, num_pages=512))
    return [o.token_ids for o in engine.generate([p for p, _ in requests], [s for _, s in requests])]


def _check_all_free(stats: list[RankStats]) -> None:
    for s in stats:
        assert s.free_pages == s.total_pages and (s.sends_in_flight, s.receives_in_flight) == (0, 0), s


def _all_pages_free(server: Server) -> None:
    ray.get(server.controller.check_integrity.remote())
    _check_all_free(ray.get(server.controller.stats.remote()))


def _serve(
    topology: Topology, tiny: Path, max_running_requests: int = 256, health_interval_s: float = 0.5
) -> Server:
    """The cluster behind its frontend: requests take the path gRPC requests take."""
    options = ServeOptions(
        topology,
        tiny,
        port=0,
        dtype="float64",
        max_running_requests=max_running_requests,
        health_interval_s=health_interval_s,
    )
    server = Server(options)
    server.start()
    return server


def _run_chats(server: Server, requests: list[tuple[list[int], SamplingParams]]) -> list[StreamSummary]:
    done: list[StreamSummary] = []
    for wave in (requests[:12], requests[12:]):  # each wave concurrently
        done += server.generate([p for p, _ in wave], [s for _, s in wave])
    return done


def _check(server: Server, tiny: Path, requests: list[tuple[list[int], SamplingParams]]) -> None:
    done = _run_chats(server, requests)
    assert [d.token_ids for d in done] == _expected(tiny, requests)
    # a second-wave request sent to a prefill rank that computed the shared prefix in the first
    # wave finds it in that rank's cache
    warm = {d.prefill_rank for d in done[:12]}
    second_wave = done[12:]
    repeated = [d.bill for d in second_wave if d.prefill_rank in warm]
    assert repeated and all(b.cached_tokens >= 2 * PAGE for b in repeated)
    assert all(d.bill.new_prompt_tokens == d.bill.prompt_tokens - d.bill.cached_tokens for d in second_wave)
    _all_pages_free(server)


def test_local_preset_matches_the_colocated_engine(tiny: Path) -> None:
    server = _serve(_topology("local"), tiny)
    try:
        _check(server, tiny, _chats(seed=1))
    finally:
        server.stop()


def test_a_decode_pool_too_small_for_all_requests(tiny: Path) -> None:
    """10 pages of 8 tokens per decode rank: requests wait in the pre-allocation queue. The
    frontend runs 5 at once: the others wait there, and none is refused."""
    server = _serve(_topology("local", decode_pages=10), tiny, max_running_requests=5)
    try:
        requests = _chats(seed=2)
        done = _run_chats(server, requests)
        assert [d.token_ids for d in done] == _expected(tiny, requests)
        _all_pages_free(server)
    finally:
        server.stop()


def test_a_failed_start_leaves_no_ranks_or_placement_groups(tiny: Path, tmp_path: Path) -> None:
    """The decode group cannot load its model: the prefill group already started is stopped
    again, and no placement group of the cluster stays reserved."""
    import dataclasses

    from tandem.cluster.group import GroupFailed
    from tandem.wire.routing_view import GroupState

    cluster = Cluster(_topology("local"), str(tiny), "float64")
    bad = cluster.decode[0]
    bad.config = dataclasses.replace(bad.config, model_dir=str(tmp_path / "missing"))
    with pytest.raises(GroupFailed, match="decode0"):
        cluster.start()
    assert [g.state for g in cluster.groups] == [GroupState.STOPPED] * len(cluster.groups)
    live = [
        pg["name"]
        for pg in ray.util.placement_group_table().values()
        if pg["state"] != "REMOVED" and pg["name"].startswith("tandem-")
    ]
    assert live == []


def test_a_prefill_rank_dying_never_leaves_a_request_hanging(tiny: Path) -> None:
    """Decode ranks whose prefill peer died mid-flight, driven directly (their results come back
    through ``collect``): each request fails with a clear error or is retried elsewhere."""
    cluster = Cluster(_topology("local", kv_timeout_s=3.0), str(tiny), "float64")
    cluster.start()
    decode = cluster.decode[0]
    try:
        ray.kill(cluster.prefill[0].actors[RankId("prefill0", 1)])
        for i in range(6):
            decode.submit(i % 2, [RankRequest(f"d{i}", (1 + i, 2, 3, 4), SamplingParams(max_tokens=4))])
        start = time.monotonic()
        done = {r.request_id: r for r in decode.run_to_completion(timeout_s=60)}
        assert time.monotonic() - start < 30 and len(done) == 6
        for result in done.values():  # each either failed with a clear error or was retried and served
            assert result.error is None or "KV transfer" in result.error, result.error
        cluster.watch()
        assert cluster.status()["prefill0"].startswith("failed"), cluster.status()
        assert decode.failure is None, decode.failure
        assert cluster.heal() == ["prefill0"]
        assert cluster.status()["prefill0"] == "ready (incarnation 2)"
        decode.submit(0, [RankRequest("after", (5, 6, 7), SamplingParams(max_tokens=3, ignore_eos=True))])
        (after,) = decode.run_to_completion(timeout_s=60)
        assert after.error is None and len(after.token_ids) == 3
        cluster.check_integrity()
        _check_all_free(cluster.stats())
    finally:
        cluster.stop()


def test_a_prefill_rank_killed_mid_flight_is_fenced_and_its_requests_complete_elsewhere(tiny: Path) -> None:
    """Six requests routed to one of two prefill ranks, which is killed as they arrive. The KV
    deadline is 30 s, yet every request completes within 10 s with the colocated engine's
    tokens: the controller confirms the rank dead, fences it on the decode rank, whose receives
    from it fail at once and are retried on the prefill rank left."""
    t = _topology("local")
    t = t.model_copy(
        update={
            "prefill": PoolSpec(groups=2, dep=1, page_size=PAGE, num_pages=160),
            "decode": PoolSpec(groups=1, dep=1, page_size=PAGE, num_pages=160),
        }
    )
    cluster = Cluster(t, str(tiny), "float64")
    cluster.start()
    # a question goes behind every message already on a rank's inbox: once answered, the decode
    # rank has taken the membership and its transports' connections, so the jobs leave for the
    # router's choice as they arrive (not after the kill, to the prefill rank left)
    cluster.check_integrity()
    decode = cluster.decode[0]
    victim = RankId("prefill0", 0)
    rng = random.Random(5)
    greedy = SamplingParams(max_tokens=4, ignore_eos=True)
    # prompts long enough that the victim is still computing some of them when it is killed
    requests = [([rng.randrange(256) for _ in range(rng.randrange(120, 180))], greedy) for _ in range(6)]
    try:
        for i, (prompt, sampling) in enumerate(requests):
            decode.submit(0, [RankRequest(f"k{i}", tuple(prompt), sampling, prefill_rank=victim)])
        ray.kill(cluster.prefill[0].actors[victim])
        start = time.monotonic()
        done: dict[str, RequestResult] = {}
        while len(done) < len(requests) and time.monotonic() - start < 60:
            cluster.watch()
            done |= {r.request_id: r for r in decode.poll(wait_s=0.2)}
        elapsed = time.monotonic() - start
        assert len(done) == len(requests) and elapsed < 10, (elapsed, sorted(done))
        results = [done[f"k{i}"] for i in range(len(requests))]
        assert [list(r.token_ids) for r in results] == _expected(tiny, requests)
        assert all(r.error is None for r in results)
        lost = [r for r in results if len(r.bill.attempts) > 1]
        assert lost, "no request was in flight on the killed rank"
        for r in lost:
            assert "was lost" in (r.bill.attempts[0].error or "") and r.prefill_rank == RankId("prefill1", 0)
        assert cluster.status()["prefill0"].startswith("failed")
        assert cluster.heal() == ["prefill0"]
        cluster.check_integrity()
        _check_all_free(cluster.stats())
    finally:
        cluster.stop()


@pytest.mark.slow
@pytest.mark.parametrize("preset", ["9xdep2-1xdep16"])  # dep16-dep2: the FP8 test below, against transformers
def test_large_presets_match_the_colocated_engine(tiny: Path, preset: str) -> None:
    server = _serve(_topology(preset), tiny)
    try:
        _check(server, tiny, _chats(seed=3))
    finally:
        server.stop()


@pytest.fixture(scope="module")
def fp8_tiny(tmp_path_factory: pytest.TempPathFactory, ray_started: None) -> Path:
    """A tiny checkpoint in DeepSeek-V3's FP8 format (32 x 32 blocks), which ranks keep FP8."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8") / "model", seed=5, fp8_block=(32, 32))


@pytest.fixture(scope="module")
def fp8_expected(fp8_tiny: Path, tmp_path_factory: pytest.TempPathFactory) -> list[list[int]]:
    """``transformers``' greedy tokens on the FP8 checkpoint dequantised, for ``FP8_PROMPTS``."""
    hf = dequantised_hf_model(fp8_tiny, tmp_path_factory.mktemp("dequantised") / "model")
    return greedy_hf_tokens(hf, FP8_PROMPTS, FP8_TOKENS)


FP8_TOKENS = 8
FP8_PROMPTS = [[random.Random(n).randrange(2, 256) for _ in range(n)] for n in (5, 17, 30)]


def _resident_bytes(model_dir: Path, rank: int, world_size: int) -> tuple[int, int]:
    """Rank ``rank`` of a DEP group of ``world_size``, in float64, built as ``load_rank_model``
    builds it but on the meta device: its resident weight bytes, counted as 1 byte an FP8
    weight and 4 a block scale, and what it would hold with the checkpoint dequantised."""
    cfg = ModelConfig.from_dir(model_dir)
    dispatcher = ExpertParallelDispatcher(rank, world_size, cfg.n_routed_experts)

    def build(keep_fp8: bool) -> DeepseekV3:
        return DeepseekV3(
            cfg, torch.float64, "meta", experts=dispatcher.local, dispatcher=dispatcher, keep_fp8=keep_fp8
        )

    params = dict(build(keep_fp8=True).named_parameters())
    scales = {n for n in params if n.endswith(("_scale_inv", "_scale"))}
    fp8_weights = sum(p.numel() for p in params.values() if p.dtype == FP8_DTYPE)
    scale_numbers = sum(params[n].numel() for n in scales)
    # float64 everywhere else, but the MoE router's weight and bias (float32)
    other_bytes = sum(
        p.numel() * p.element_size() for n, p in params.items() if p.dtype != FP8_DTYPE and n not in scales
    )
    assert build(keep_fp8=False).weight_bytes() == 8 * fp8_weights + other_bytes
    return fp8_weights + 4 * scale_numbers + other_bytes, 8 * fp8_weights + other_bytes


@pytest.mark.parametrize("preset", ["local", pytest.param("dep16-dep2", marks=pytest.mark.slow)])
def test_an_fp8_checkpoint_stays_fp8_on_the_ranks_and_gives_transformers_tokens(
    fp8_tiny: Path, fp8_expected: list[list[int]], preset: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every rank keeps its share of the FP8 checkpoint FP8 (1 byte a weight, 4 a block scale),
    reports those bytes to ``tandem client status``, and the cluster's greedy tokens are
    ``transformers``' on the dequantised checkpoint."""
    from tandem.cli.main import main

    topology = _topology(preset)
    server = _serve(topology, fp8_tiny)
    try:
        greedy = SamplingParams(max_tokens=FP8_TOKENS, ignore_eos=True)
        done = server.generate(FP8_PROMPTS, [greedy] * len(FP8_PROMPTS))
        assert [d.token_ids for d in done] == fp8_expected
        stats = ray.get(server.controller.stats.remote())
        deps = {"prefill": topology.prefill.dep, "decode": topology.decode.dep}
        assert len(stats) == sum(deps.values())
        reported = {}
        for s in stats:
            fp8_bytes, dequantised_bytes = _resident_bytes(fp8_tiny, s.rank.rank, deps[s.role])
            assert s.weight_bytes == fp8_bytes < dequantised_bytes, s.rank
            reported[s.rank.name] = s.weight_bytes
        capsys.readouterr()
        assert main(["client", "status", "--check-integrity", "--addr", f"127.0.0.1:{server.port}"]) == 0
        out = capsys.readouterr().out  # after any line Ray's log monitor printed on this stdout
        shown = json.loads(out[out.index("{\n") :])
        assert {r["name"]: r["weight_bytes"] for g in shown["groups"] for r in g["ranks"]} == reported
        _all_pages_free(server)
    finally:
        server.stop()


def test_disagg_benchmark_reports_ttft_itl_and_exposed_share(tiny: Path) -> None:
    from tandem.bench.disagg_bench import run_disagg_bench

    result = run_disagg_bench(tiny, "local", [2], requests=2, prompt_tokens=16, output_tokens=3)
    (row,) = result["runs"]
    for config in ("colocated", "disaggregated_layerwise", "disaggregated_whole"):
        assert row[config]["ttft_ms_mean"] > 0 and row[config]["itl_ms_mean"] > 0
    for mode in ("layerwise", "whole"):
        assert 0 <= row[f"disaggregated_{mode}"]["kv_exposed_share_of_ttft"] <= 1


def test_generate_preset_through_the_named_controller(
    tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import json

    from tandem.cli.main import main

    prompts = tmp_path / "p.jsonl"
    lines = [
        {"prompt": "Hello, Tandem"},
        {"prompt_ids": [5, 6, 7]},
        {"prompt": "x" * 40, "seed": 3, "temperature": 0.7},
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines))
    base = [
        "generate",
        "--model",
        str(tiny),
        "--prompts-file",
        str(prompts),
        "--max-tokens",
        "5",
        "--ignore-eos",
    ]
    base += ["--dtype", "float64", "--json"]
    assert main([*base, "--preset", "local"]) == 0
    disaggregated = json.loads(capsys.readouterr().out)["outputs"]
    assert main(base) == 0
    colocated = json.loads(capsys.readouterr().out)["outputs"]
    assert [o["token_ids"] for o in disaggregated] == [o["token_ids"] for o in colocated]
    for out in disaggregated:
        bill = out["bill"]
        assert bill["cached_tokens"] + bill["new_prompt_tokens"] == out["prompt_tokens"]
        assert len(bill["token_times_s"]) == 5 and bill["attempts"] == 1
        latency = bill["latency"]
        assert 0 < latency["ttft"] <= latency["e2e"] and latency["kv_transfer"] > 0
        # the composition's parts are each within end-to-end, and so is their sum
        assert sum(latency[part] for part in ("queue", "routing", "pickup", "reservation_wait", "kv_wait",
                                              "kv_accept", "decode")) <= latency["e2e"]  # fmt: skip
        assert (
            out["placement"]["prefill"]["group"] == "prefill0"
            and out["placement"]["decode"]["group"] == "decode0"
        )


def test_a_crashed_controller_comes_back_and_adopts_the_running_groups(tiny: Path) -> None:
    """The controller is killed while a long request streams: the stream completes with the
    colocated engine's tokens (the ranks and the frontend never needed the controller for it).
    Ray restarts the controller, which finds the ranks by name and adopts them (incarnation 1
    still: nothing was rebuilt); the frontend is served again and a new request completes;
    stopping the server leaves no rank actor behind."""
    import threading

    from tandem.cluster.deployment import rank_actors

    server = _serve(_topology("local"), tiny)
    namespace = ray.get_runtime_context().namespace
    long_request = ([7, 1, 5, 3], SamplingParams(max_tokens=600, ignore_eos=True))
    after = ([9, 2, 4], SamplingParams(max_tokens=5, ignore_eos=True))
    try:
        before = ray.get(server.controller.status.remote())
        streamed: list[StreamSummary] = []
        prompt, sampling = long_request
        thread = threading.Thread(target=lambda: streamed.extend(server.generate([prompt], [sampling])))
        thread.start()
        time.sleep(1.0)
        assert thread.is_alive(), "the request ended before the controller was killed"
        ray.kill(server.controller, no_restart=False)
        thread.join(timeout=300)
        (summary,) = streamed
        assert summary.error is None and summary.token_ids == _expected(tiny, [long_request])[0]
        deadline = time.monotonic() + 120
        status = None
        while status is None and time.monotonic() < deadline:
            try:
                status = ray.get(server.controller.status.remote(), timeout=10)
            except ray.exceptions.RayError:
                time.sleep(0.5)
        assert status == before  # adopted: every group ready, incarnation 1
        assert ray.get(server.frontend.wait_ready.remote(120))
        (again,) = server.generate([after[0]], [after[1]])
        assert again.error is None and again.token_ids == _expected(tiny, [after])[0]
        _all_pages_free(server)
    finally:
        server.stop()
    assert rank_actors(namespace) == []


def test_a_decode_rank_killed_mid_stream_hands_its_streams_to_another_and_they_finish_exactly(
    tiny: Path,
) -> None:
    """Two decode groups; six long streams (greedy and seeded) spread over both; one decode rank
    is killed while they stream. Every stream ends without an error and with the colocated
    engine's tokens: the frontend resumed the killed rank's requests on the other decode rank
    from the tokens already streamed (their bills count one migration), and every page is free
    at the end."""
    import threading

    t = _topology("local")
    t = t.model_copy(
        update={
            "prefill": PoolSpec(groups=1, dep=1, page_size=PAGE, num_pages=200),
            "decode": PoolSpec(groups=2, dep=1, page_size=PAGE, num_pages=200),
        }
    )
    server = _serve(t, tiny)
    rng = random.Random(9)
    requests = [
        (
            [rng.randrange(256) for _ in range(rng.randrange(5, 30))],
            SamplingParams(max_tokens=1000, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i),
        )
        for i in range(6)
    ]
    try:
        done: list[StreamSummary] = []
        prompts, samplings = [p for p, _ in requests], [s for _, s in requests]
        thread = threading.Thread(target=lambda: done.extend(server.generate(prompts, samplings)))
        thread.start()
        time.sleep(1.5)
        assert thread.is_alive(), "the streams ended before a decode rank was killed"
        view = ray.get(server.controller.routing_view.remote())
        ray.kill(view.decode[RankId("decode0", 0)])
        thread.join(timeout=300)
        assert [d.error for d in done] == [None] * len(requests)
        assert [d.token_ids for d in done] == _expected(tiny, requests)
        moved = [d for d in done if d.bill.migrations]
        assert moved and all(d.bill.migrations == 1 and d.decode_rank == RankId("decode1", 0) for d in moved)
        deadline = time.monotonic() + 120  # the killed group is rebuilt; then every page is free
        while not all(s.startswith("ready") for s in ray.get(server.controller.status.remote()).values()):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        _all_pages_free(server)
    finally:
        server.stop()


@pytest.mark.parametrize("dep", [2])  # the reference topology's decode group; DEP4 took 50 s more
def test_a_rank_killed_in_a_dep_decode_group_loses_no_stream_of_its_peers(tiny: Path, dep: int) -> None:
    """One decode group of ``dep`` ranks, two long streams on each rank (one greedy, one unseeded
    at temperature 1); one rank is killed. The controller looks at its groups only every 3 s, so
    the peers' loops fail on the broken collective and report it first: that is their rank's
    failure, not their requests', and their streams wait for the group's rebuild and resume there
    like the killed rank's. Every stream ends without an error and with the tokens of an
    undisturbed run (an unseeded one with the seed its bill reports)."""
    import threading

    t = _topology("local").model_copy(
        update={
            "prefill": PoolSpec(groups=1, dep=1, page_size=PAGE, num_pages=200),
            "decode": PoolSpec(groups=1, dep=dep, page_size=PAGE, num_pages=200),
        }
    )
    server = _serve(t, tiny, health_interval_s=30.0)
    rng = random.Random(dep)
    requests = [
        (
            [rng.randrange(256) for _ in range(rng.randrange(5, 20))],
            SamplingParams(max_tokens=400, ignore_eos=True, temperature=1.0 if i % 2 else 0.0),
        )
        for i in range(2 * dep)
    ]
    try:
        done: list[StreamSummary] = []
        prompts, samplings = [p for p, _ in requests], [s for _, s in requests]
        thread = threading.Thread(target=lambda: done.extend(server.generate(prompts, samplings)))
        thread.start()
        deadline = time.monotonic() + 60
        while True:  # every rank of the group streams
            decode = [s for s in ray.get(server.controller.stats.remote()) if s.role.value == "decode"]
            if len(decode) == dep and all(s.running for s in decode):
                break
            assert time.monotonic() < deadline and thread.is_alive(), decode
            time.sleep(0.05)
        view = ray.get(server.controller.routing_view.remote())
        ray.kill(view.decode[RankId("decode0", 0)])
        thread.join(timeout=400)
        assert [d.error for d in done] == [None] * len(requests)
        assert all(d.bill.migrations == 1 for d in done)  # the peers' streams moved too
        replayed = [
            (p, dataclasses.replace(s, seed=d.bill.seed)) for (p, s), d in zip(requests, done, strict=True)
        ]
        assert [d.token_ids for d in done] == _expected(tiny, replayed)
        _all_pages_free(server)
    finally:
        server.stop()


def test_a_killed_frontend_leaves_no_request_running_on_the_ranks(tiny: Path) -> None:
    """Three long streams (1500 tokens each) run when their frontend is killed: the decode ranks
    end them long before they would have finished (the frontend is gone, or came back without
    their streams and has them aborted), every page comes back, and the frontend serves again."""
    import threading

    server = _serve(_topology("local", decode_pages=640), tiny)  # three streams of 1500 tokens
    long = SamplingParams(max_tokens=1500, ignore_eos=True)
    try:
        failed: list[BaseException] = []

        def run() -> None:
            try:
                server.generate([[3, 1, 4], [1, 5, 9], [2, 6, 5]], [long] * 3)
            except ray.exceptions.RayError as exc:
                failed.append(exc)

        thread = threading.Thread(target=run)
        thread.start()
        time.sleep(1.5)
        assert thread.is_alive(), "the streams ended before the frontend was killed"
        at_kill = ray.get(server.controller.stats.remote())
        steps_at_kill = max(s.loop.steps for s in at_kill if s.role.value == "decode")
        ray.kill(server.frontend, no_restart=False)
        thread.join(timeout=120)
        assert failed  # the caller's frontend died under it
        deadline = time.monotonic() + 120
        while True:
            stats = ray.get(server.controller.stats.remote())
            if all(s.running + s.queued + s.waiting_for_kv == 0 for s in stats):
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.2)
        decode_steps = max(s.loop.steps for s in stats if s.role.value == "decode") - steps_at_kill
        assert decode_steps < 1000  # ended early: finishing would have taken ~1500 more steps
        _all_pages_free(server)
        # the ranks end its streams as soon as its channels close: it may still be restarting
        deadline = time.monotonic() + 120
        while True:
            try:
                assert ray.get(server.frontend.wait_ready.remote(120))
                break
            except ray.exceptions.ActorUnavailableError:
                assert time.monotonic() < deadline, "the frontend did not come back"
                time.sleep(0.5)
        short = ([7, 7, 7], SamplingParams(max_tokens=3, ignore_eos=True))
        (again,) = server.generate([short[0]], [short[1]])
        assert again.error is None and again.token_ids == _expected(tiny, [short])[0]
    finally:
        server.stop()


def test_membership_and_draining(tiny: Path) -> None:
    cluster = Cluster(_topology("local"), str(tiny), "float64")
    cluster.start()
    try:
        view = cluster.routing_view()
        assert sorted(view.prefill) == [RankId("prefill0", 0), RankId("prefill0", 1)]
        assert sorted(view.decode) == [RankId("decode0", 0), RankId("decode0", 1)]
        cluster.drain("prefill0")
        assert cluster.routing_view().prefill == {} and cluster.status()["prefill0"].startswith("draining")
        cluster.drain("decode0")
        assert cluster.routing_view().decode == {} and cluster.status()["decode0"].startswith("draining")
        with pytest.raises(ValueError, match="no group 'decode9'"):
            cluster.drain("decode9")
    finally:
        cluster.stop()
