"""DeepSeek-V4 in DEP groups of real Ray actors on loopback (data-parallel attention, routed
experts split over the ranks and exchanged by all-to-all, every layer hash-routed or scored):
greedy tokens equal transformers' ``generate`` with a sparse indexer (under the lowest-index
tie rule, ``tests/hf_v4_reference.py``), for DEP sizes 2 and 3, prompts chunked or whole."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tandem.cluster.group import GroupConfig, RankGroup
from tandem.engine.colocated_role import ColocatedRole
from tandem.engine.engine_config import EngineConfig
from tandem.wire.messages import RankRequest
from tandem.wire.request_params import SamplingParams
from tests.hf_v4_reference import hf_greedy, hf_v4, lowest_index_ties, write_tiny_v4

PROMPTS = [[random.Random(n).randrange(256) for _ in range(n)] for n in (5, 17, 64, 131, 300)]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def sparse(tmp_path_factory: pytest.TempPathFactory, ray_started: None) -> tuple[Path, list[list[int]]]:
    directory = tmp_path_factory.mktemp("v4") / "model"
    write_tiny_v4(directory, seed=3, index_topk=3)
    hf = hf_v4(directory)
    with lowest_index_ties():
        return directory, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


@pytest.mark.parametrize(("dep", "chunk"), [(2, None), (3, 7)])
def test_a_v4_dep_group_gives_transformers_tokens(
    sparse: tuple[Path, list[list[int]]], dep: int, chunk: int | None
) -> None:
    model_dir, want = sparse
    engine = EngineConfig(page_size=16, num_pages=128, prefill_chunk_tokens=chunk)
    group = RankGroup(GroupConfig(f"v4-dep{dep}", str(model_dir), dep, ColocatedRole(engine), "float32"))
    group.start()
    try:
        for i, prompt in enumerate(PROMPTS):  # rank i % dep: every rank has work, of uneven sizes
            sampling = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
            group.submit(i % dep, [RankRequest(f"r{i}", tuple(prompt), sampling)])
        done = {r.request_id: r for r in group.run_to_completion(timeout_s=300)}
        assert [list(done[f"r{i}"].token_ids) for i in range(len(PROMPTS))] == want
        stats = group.stats()
        assert len({s.loop.steps for s in stats}) == 1  # lockstep, empty batches included
        assert all(s.moe_rows_received > 0 for s in stats)  # each served its experts to the others
        assert all(s.running == s.queued == 0 and s.free_pages == engine.num_pages for s in stats)
    finally:
        group.stop()
