"""The local preset (DEP2 prefill + DEP2 decode) with every KV tier on: small device pools, a
host tier per prefill rank and the deployment's own Mooncake store (``store: {}``: the
controller starts ``mooncake_master`` and stops it with the deployment). Tokens equal the
colocated engine's (itself checked against ``transformers``) through ``Server`` and over gRPC;
prefixes come back from the host tier and from the store (each of the two prefill ranks reads
what the other computed); the bills say which tier, the gRPC summary too; every page is free at
the end and the master is gone after the stop."""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import pytest
import ray
import torch

from tandem.client.grpc_client import ClientOptions, generate_all
from tandem.client.prompts import PromptSpec
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import PoolSpec, StoreSpec, Topology
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.wire.messages import CachedByTier
from tandem.wire.request_params import SamplingParams

PAGE = 8


@pytest.fixture(scope="module")
def tiny(tiny_dir: Path, ray_started: None) -> Path:
    return tiny_dir


def _topology() -> Topology:
    t = Topology.preset("local")
    # 12 device and 4 host pages of 8 tokens per prefill rank: a conversation's prefix leaves the
    # device for the host with the next one or two, and the host for the store (only) after that
    prefill = PoolSpec(groups=1, dep=2, page_size=PAGE, num_pages=12, host_cache_pages=4)
    decode = PoolSpec(groups=1, dep=2, page_size=PAGE, num_pages=128)
    return t.model_copy(update={"prefill": prefill, "decode": decode, "store": StoreSpec(segment_mb=32)})


def test_every_tier_on_the_local_preset_gives_the_colocated_engines_tokens(tiny: Path) -> None:
    rng = random.Random(5)
    conversations = [[rng.randrange(256) for _ in range(5 * PAGE + 3)] for _ in range(6)]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=11)
    first = [(c, greedy if i % 2 else seeded) for i, c in enumerate(conversations)]
    # each conversation again, with new text: its prefix was evicted from the device since
    second = [(c + [rng.randrange(256) for _ in range(3)], s) for c, s in first]
    engine = ColocatedEngine.from_model_dir(tiny, torch.float64, EngineConfig(page_size=PAGE, num_pages=512))
    expected = [
        o.token_ids for o in engine.generate([p for p, _ in first + second], [s for _, s in first + second])
    ]

    server = Server(ServeOptions(_topology(), tiny, port=0, dtype="float64"))
    server.start()
    master = None
    try:
        master = ray.get(server.controller.store_master_pid.remote())
        assert master is not None
        done = []
        for prompt, sampling in first:  # one at a time: each evicts the one before on its rank
            done += server.generate([prompt], [sampling])
        done += server.generate([p for p, _ in second], [s for _, s in second])
        assert [d.token_ids for d in done] == expected
        tiers = CachedByTier()
        for d in done[len(first) :]:
            bill = d.bill
            assert bill.cached_tokens_by_tier.total == bill.cached_tokens
            tiers = tiers.plus(bill.cached_tokens_by_tier)
        # the second turns found most of their 5 full pages each, from every tier (a rank may
        # price a short store run slower than computing it, and compute it)
        assert tiers.total >= 0.8 * len(second) * 5 * PAGE, tiers
        assert tiers.device > 0 and tiers.host > 0 and tiers.store > 0, tiers

        # over gRPC: the summary's bill carries the split. Its 5 full pages are found in some
        # tier; a run a rank priced slower to load than to compute (a loaded machine's clock) is
        # computed instead and counted as recomputed
        recomputed = _recomputed(server)
        spec = PromptSpec(None, conversations[0] + [7, 7], greedy)
        (outcome,) = asyncio.run(
            generate_all(ClientOptions(f"127.0.0.1:{server.port}", timeout_s=120), [spec], 1)
        )
        record = outcome.record()
        split = record["cached_tokens_by_tier"]
        assert set(split) == {"device", "host", "store"}
        assert sum(split.values()) == record["cached_tokens"] > 0
        assert record["cached_tokens"] + _recomputed(server) - recomputed == 5 * PAGE
        (want,) = engine.generate([conversations[0] + [7, 7]], [greedy])
        assert record["token_ids"] == want.token_ids

        ray.get(server.controller.check_integrity.remote())
        stats = ray.get(server.controller.stats.remote())
        for s in stats:
            assert s.free_pages == s.total_pages, s
        # prefill ranks wrote what they computed, decode ranks what they finished
        assert all(s.tiers.store_writes > 0 and s.tiers.store_errors == 0 for s in stats), stats
    finally:
        server.stop()
    if master is not None:  # the deployment's master stopped with it
        deadline = time.monotonic() + 10
        while _alive(master) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(master)


def _recomputed(server: Server) -> int:
    """Prompt tokens the ranks found in a tier but computed, priced cheaper than loading."""
    return sum(s.tiers.recomputed_tokens for s in ray.get(server.controller.stats.remote()))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
