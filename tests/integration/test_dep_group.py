"""DEP groups of real Ray actors on loopback: exact tokens, DEP16, rank failure and gang restart."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import ray
import torch

from tandem.cli.main import main
from tandem.cluster.group import GroupConfig, GroupFailed, GroupNotReady, RankGroup
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.colocated_role import ColocatedRole
from tandem.engine.engine_config import EngineConfig
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.wire.messages import RankId, RankRequest, RequestResult
from tandem.wire.request_params import InvalidRequestError, SamplingParams
from tandem.wire.routing_view import GroupState

ENGINE = EngineConfig(page_size=8, num_pages=96)


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path, ray_started: None) -> Path:
    return tiny_dir


def _requests(n: int, seed: int) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    return [
        (
            [rng.randrange(258) for _ in range(rng.randrange(1, 40))],
            SamplingParams(max_tokens=3 + 2 * i, ignore_eos=True),
        )
        for i in range(n)
    ]


def _colocated(tiny: Path, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    engine = ColocatedEngine.from_model_dir(tiny, torch.float64, ENGINE)
    return [o.token_ids for o in engine.generate([p for p, _ in requests], [s for _, s in requests])]


def _tokens(result: RequestResult) -> list[int]:
    return list(result.token_ids)


def _run(
    group: RankGroup, requests: list[tuple[list[int], SamplingParams]], ranks: list[int]
) -> dict[str, RequestResult]:
    for i, ((prompt, sampling), rank) in enumerate(zip(requests, ranks, strict=True)):
        group.submit(rank, [RankRequest(f"r{i}", tuple(prompt), sampling)])
    return {r.request_id: r for r in group.run_to_completion(timeout_s=300)}


def _check_all_pages_free(group: RankGroup) -> None:
    group.check_integrity()
    for s in group.stats():
        assert s.running == s.queued == 0 and s.free_pages == ENGINE.num_pages


def test_dep4_uneven_load_matches_the_colocated_engine(tiny: Path) -> None:
    """16 requests of different lengths over 4 ranks, 7/5/4/0: rank 3 never has a request and the
    others run out at different steps, so ranks step on empty batches. Compared in float64,
    where summing expert outputs that come from other ranks rounds exactly alike."""
    requests = _requests(16, seed=1)
    group = RankGroup(GroupConfig("dep4", str(tiny), 4, ColocatedRole(ENGINE), "float64"))
    group.start()
    try:
        assert group.state is GroupState.READY and group.incarnation == 1
        done = _run(group, requests, [0] * 7 + [1] * 5 + [2] * 4)
        assert [_tokens(done[f"r{i}"]) for i in range(16)] == _colocated(tiny, requests)
        assert all(done[f"r{i}"].finish_reason == "length" for i in range(16))
        stats = group.stats()
        assert len({s.loop.steps for s in stats}) == 1  # lockstep: every rank took every step
        assert [s.local_experts for s in stats] == [4, 4, 4, 4]  # 16 routed experts, a quarter each
        assert stats[3].moe_rows_received > 0  # the idle rank served its experts to the others
        _check_all_pages_free(group)
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            group.submit(1, [RankRequest("bad", (1, 258), SamplingParams(max_tokens=2))])
    finally:
        group.stop()
    assert group.state is GroupState.STOPPED


@pytest.mark.slow
def test_dep16_with_12_experts_matches(tiny: Path, tmp_path: Path) -> None:
    """12 routed experts over 16 ranks: ranks 0..11 hold one each, ranks 12..15 none (they
    serve attention and route their tokens to the others); the tokens are the colocated
    engine's."""
    model = make_tiny_checkpoint(tmp_path / "tiny12", seed=0, n_routed_experts=12)
    requests = _requests(12, seed=2)
    group = RankGroup(GroupConfig("dep16", str(model), 16, ColocatedRole(ENGINE), "float64"))
    group.start()
    try:
        # ranks 0..4 and 13 take requests; the others stay idle
        done = _run(group, requests, [i % 5 for i in range(11)] + [13])
        assert [_tokens(done[f"r{i}"]) for i in range(12)] == _colocated(model, requests)
        stats = group.stats()
        assert [s.local_experts for s in stats] == [1] * 12 + [0] * 4
        assert all(s.moe_rows_received == 0 for s in stats[12:])
        _check_all_pages_free(group)
    finally:
        group.stop()


def test_killed_rank_fails_the_group_and_it_restarts_whole(tiny: Path) -> None:
    group = RankGroup(
        GroupConfig("dep2", str(tiny), 2, ColocatedRole(ENGINE), "float32", collective_timeout_s=30)
    )
    group.start()
    try:
        long = SamplingParams(max_tokens=700, ignore_eos=True)
        group.submit(0, [RankRequest("a", (1, 2, 3), long), RankRequest("b", (4, 5), long)])
        group.submit(1, [RankRequest("c", (6, 7, 8, 9), long)])
        deadline = time.monotonic() + 60
        while not all(s.loop.steps > 0 for s in group.stats()):
            assert time.monotonic() < deadline
            time.sleep(0.05)

        # step 1: a rank dies mid-generation
        ray.kill(group.actors[RankId("dep2", 1)])
        # step 2: within a bounded time the group is failed and every request in flight ends with the error
        killed = time.monotonic()
        ended: dict[str, RequestResult] = {}
        while len(ended) < 3:
            assert time.monotonic() - killed < 30, "requests still hanging after a rank died"
            ended.update({r.request_id: r for r in group.poll()})
        assert group.state is GroupState.FAILED
        for r in ended.values():
            assert r.finish_reason == "error" and r.error is not None
            assert "DEP group dep2 incarnation 1 failed" in r.error and "rank 1" in r.error
        with pytest.raises(GroupNotReady):
            group.submit(0, [RankRequest("d", (1,), long)])

        # step 3: gang restart, a new incarnation that serves again
        group.restart()
        assert group.state is GroupState.READY and group.incarnation == 2
        done = _run(group, [([1, 2, 3], SamplingParams(max_tokens=5, ignore_eos=True))], [1])
        assert len(done["r0"].token_ids) == 5 and done["r0"].error is None
        _check_all_pages_free(group)
    finally:
        group.stop()


def test_a_node_without_the_model_fails_the_start_naming_the_node(tiny: Path, tmp_path: Path) -> None:
    """Each rank checks, on its own node, that the model is there before anything loads: a node
    that lacks it fails the group's start with an error naming the node, and leaves nothing."""
    missing = tmp_path / "not-on-this-node"
    group = RankGroup(GroupConfig("nomodel", str(missing), 2, ColocatedRole(ENGINE), start_timeout_s=60))
    started = time.monotonic()
    with pytest.raises(GroupFailed) as failed:
        group.start()
    assert time.monotonic() - started < 60
    message = str(failed.value)
    assert f"model_dir: {missing} holds no config.json on node" in message, message
    assert ray.get_runtime_context().get_node_id()[:12] in message
    assert group.state is GroupState.FAILED and group.actors == {}


def test_generate_cli_with_dep(tiny: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(
        "\n".join(json.dumps({"prompt_ids": p}) for p in ([5, 6, 7], [8], [9, 10, 11, 12, 13]))
    )
    base = ["generate", "--model", str(tiny), "--prompts-file", str(prompts), "--max-tokens", "6"]
    base += ["--ignore-eos", "--dtype", "float64", "--page-size", "8", "--json"]
    assert main([*base, "--dep", "2"]) == 0
    with_dep = json.loads(capsys.readouterr().out)["outputs"]
    assert main(base) == 0
    alone = json.loads(capsys.readouterr().out)["outputs"]
    assert with_dep == alone
    # bad ids are rejected before any actor starts
    bad = ["generate", "--model", str(tiny), "--prompt-ids", "0,1,999", "--max-tokens", "6", "--dep", "2"]
    assert main(bad) == 2 and "outside the vocabulary" in capsys.readouterr().err


def test_dep_benchmark_reports_all_to_all(tiny: Path) -> None:
    from tandem.bench.dep_bench import run_dep_bench

    result = run_dep_bench(tiny, [1, 2], requests_per_rank=2, prompt_tokens=8, output_tokens=4)
    assert [r["dep"] for r in result["runs"]] == [1, 2]
    for run in result["runs"]:
        assert run["steps"] >= 4 and run["step_ms"] > 0
    one, two = result["runs"]
    assert one["all_to_all_ms_per_step"] == 0  # a group of one exchanges nothing
    assert 0 < two["all_to_all_ms_per_step"] < two["step_ms"]
