"""DeepSeek-V4 on the disaggregated cluster (Ray, real NIXL): a tiny V4 through ``local`` (a DEP2
prefill group, a DEP2 decode group) gives the colocated engine's tokens (themselves
transformers', ``tests/engine/test_v4_engine.py``), greedy and seeded, over the path gRPC
requests take and over the OpenAI API with the official client; a second wave sharing the
first's prefixes hits the prefill ranks' caches (restored exactly from their window slots); every
page and every state slot is free at the end. Each request's compressed entries and indexer keys
cross in its pages and the rest of its state in a slot, layer by layer: the bill's bytes are
those of the prompt's pages of each kind and one slot."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
import ray
import torch

from tandem.bench.v4_transfer_bytes import transfer_bytes
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import PoolSpec, Topology
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.model.v4.config import V4Config
from tandem.wire.request_params import SamplingParams
from tests.hf_v4_reference import write_tiny_v4

PAGE = 16  # a multiple of the tiny model's rates 4 and 16


@dataclass
class Served:
    server: Server
    model_dir: Path
    base_url: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, ray_started: None) -> Iterator[Served]:
    model_dir = tmp_path_factory.mktemp("v4cluster") / "model"
    write_tiny_v4(model_dir, seed=3, index_topk=3)
    pool = PoolSpec(dep=2, page_size=PAGE, num_pages=120, max_num_seqs=16)
    topology = Topology.preset("local").model_copy(update={"prefill": pool, "decode": pool})
    server = Server(ServeOptions(topology, model_dir, port=0, dtype="float64", http_port=0))
    try:
        server.start()
        assert server.http_address is not None
        yield Served(server, model_dir, f"http://{server.http_address}/v1")
    finally:
        server.stop()


def _chats(seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Two waves of 8: the second extends the first's prompts (a shared system prompt of three
    pages, then each turn). Odd requests sample with a seed."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 256) for _ in range(3 * PAGE)]
    first = [system + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))] for _ in range(8)]
    second = [p + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 20))] for p in first]
    return [
        (p, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i))
        for i, p in enumerate(first + second)
    ]


def _expected(model_dir: Path, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    engine = ColocatedEngine.from_model_dir(
        model_dir, torch.float64, EngineConfig(page_size=PAGE, num_pages=512)
    )
    return [o.token_ids for o in engine.generate([p for p, _ in requests], [s for _, s in requests])]


def test_the_local_preset_gives_the_colocated_tokens_and_its_prefix_hits(served: Served) -> None:
    requests = _chats(seed=1)
    done = []
    for wave in (requests[:8], requests[8:]):
        done += served.server.generate([p for p, _ in wave], [s for _, s in wave])
    assert [d.error for d in done] == [None] * len(requests)
    assert [d.token_ids for d in done] == _expected(served.model_dir, requests)
    cfg = V4Config.from_dir(served.model_dir)
    for d, (prompt, _) in zip(done, requests, strict=True):  # the layout's bytes, float64
        assert d.bill.kv_bytes == transfer_bytes(cfg, len(prompt), PAGE, 8), (len(prompt), d.bill)
    warm = {d.prefill_rank for d in done[:8]}
    repeated = [d.bill for d in done[8:] if d.prefill_rank in warm]
    assert repeated and all(b.cached_tokens >= 2 * PAGE for b in repeated)
    ray.get(served.server.controller.check_integrity.remote())
    for stats in ray.get(served.server.controller.stats.remote()):
        assert stats.free_pages == stats.total_pages, stats
        assert (stats.sends_in_flight, stats.receives_in_flight) == (0, 0), stats


def test_the_openai_api_gives_the_colocated_tokens(served: Served) -> None:
    client = openai.OpenAI(base_url=served.base_url, api_key="none", max_retries=0, timeout=120)
    prompt = [random.Random(7).randrange(3, 256) for _ in range(45)]
    whole = client.completions.create(
        model=served.server.model_name,
        prompt=prompt,
        max_tokens=10,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    got = whole.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert got == _expected(served.model_dir, [(prompt, SamplingParams(max_tokens=10, ignore_eos=True))])[0]
