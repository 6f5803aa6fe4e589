"""DeepSeek-V4 on the local preset (DEP2 prefill + DEP2 decode) with every KV tier on: small
device pools, a host tier per prefill rank and the deployment's own Mooncake store. A V4 block
is a page's entries of each kind (compressed entries, indexer keys) and, on the pages that keep
it, the window KV and overlap a hit restores from; the tokens equal the colocated engine's
(itself checked against transformers), prefixes come back from the lower tiers, each of the two
prefill ranks reading what the other computed, and every page is free at the end. A decode rank
writes a finished request's pages back with their boundary state, so a next turn's hit runs
through the answer too."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import ray
import torch

from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import PoolSpec, StoreSpec, Topology
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.wire.messages import CachedByTier, Role
from tandem.wire.request_params import SamplingParams
from tests.hf_v4_reference import write_tiny_v4

PAGE = 16  # a multiple of the tiny model's rates 4 and 16


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory, ray_started: None) -> Path:
    directory = tmp_path_factory.mktemp("v4tiers") / "model"
    write_tiny_v4(directory, seed=3, index_topk=3)
    return directory


def _topology() -> Topology:
    # 8 device pages (2 window slots) and 8 host pages of 16 tokens per prefill rank: a
    # conversation's prefix leaves the device with the next one, the host with the one after
    prefill = PoolSpec(groups=1, dep=2, page_size=PAGE, num_pages=8, host_cache_pages=8)
    decode = PoolSpec(groups=1, dep=2, page_size=PAGE, num_pages=128)
    t = Topology.preset("local")
    return t.model_copy(update={"prefill": prefill, "decode": decode, "store": StoreSpec(segment_mb=32)})


def test_every_tier_with_v4_state_gives_the_colocated_engines_tokens(model_dir: Path) -> None:
    rng = random.Random(5)
    conversations = [[rng.randrange(3, 256) for _ in range(5 * PAGE + 3)] for _ in range(6)]
    greedy = SamplingParams(max_tokens=6, ignore_eos=True)
    seeded = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.8, seed=11)
    first = [(c, greedy if i % 2 else seeded) for i, c in enumerate(conversations)]
    second = [(c + [rng.randrange(3, 256) for _ in range(3)], s) for c, s in first]
    engine = ColocatedEngine.from_model_dir(
        model_dir, torch.float64, EngineConfig(page_size=PAGE, num_pages=512)
    )
    requests = first + second
    expected = [o.token_ids for o in engine.generate([p for p, _ in requests], [s for _, s in requests])]

    server = Server(ServeOptions(_topology(), model_dir, port=0, dtype="float64"))
    server.start()
    try:
        done = []
        for prompt, sampling in first:  # one at a time: each evicts the ones before on its rank
            done += server.generate([prompt], [sampling])
        done += server.generate([p for p, _ in second], [s for _, s in second])
        assert [d.token_ids for d in done] == expected
        tiers = CachedByTier()
        for d in done[len(first) :]:
            assert d.bill.cached_tokens_by_tier.total == d.bill.cached_tokens
            tiers = tiers.plus(d.bill.cached_tokens_by_tier)
        # measured: 0 device, 160 host, 80 store on an idle machine. Under load a rank may find
        # the store's answer later than recomputing is priced at: a miss, counted as slow
        stats = ray.get(server.controller.stats.remote())
        slow = sum(s.tiers.store_slow + s.tiers.recomputed_tokens for s in stats if s.role is Role.PREFILL)
        assert tiers.host > 0 and (tiers.store > 0 or slow > 0), (tiers, slow)

        ray.get(server.controller.check_integrity.remote())
        stats = ray.get(server.controller.stats.remote())
        for s in stats:
            assert s.free_pages == s.total_pages, s
        prefill = [s.tiers for s in stats if s.role is Role.PREFILL]
        assert all(t.store_writes > 0 and t.store_errors == t.store_rejected == 0 for t in prefill), prefill
        assert all(t.store_load_bytes > 0 for t in prefill) or sum(t.host_load_bytes for t in prefill) > 0
        # a loaded token moves its entries and, on a share of the pages, their window KV
        assert all(t.kv_bytes_per_token > 0 for t in prefill)
    finally:
        server.stop()


def test_a_second_turn_hits_the_pages_the_decode_rank_wrote_back(model_dir: Path) -> None:
    """A first turn whose answer completes two pages on the decode rank: they are written back to
    the store with their window KV and overlap (the decode rank keeps window slots when the
    deployment has a store), and the next turn's hit runs through them to the last one, with
    the colocated engine's tokens."""
    rng = random.Random(9)
    prompt = [rng.randrange(3, 256) for _ in range(5 * PAGE + 3)]
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    engine = ColocatedEngine.from_model_dir(
        model_dir, torch.float64, EngineConfig(page_size=PAGE, num_pages=512)
    )
    (first,) = engine.generate([prompt], [sampling])
    turn = prompt + first.token_ids + [rng.randrange(3, 256) for _ in range(3)]  # 126 tokens
    (want,) = engine.generate([turn], [sampling])

    prefill = PoolSpec(groups=1, dep=1, page_size=PAGE, num_pages=64)
    decode = PoolSpec(groups=1, dep=1, page_size=PAGE, num_pages=64)
    topology = Topology.preset("local").model_copy(
        update={"prefill": prefill, "decode": decode, "store": StoreSpec(segment_mb=32)}
    )
    server = Server(ServeOptions(topology, model_dir, port=0, dtype="float64"))
    server.start()
    try:
        (done,) = server.generate([prompt], [sampling])
        assert done.token_ids == first.token_ids
        deadline = time.monotonic() + 30  # the decode rank's writer thread stores its 7 full pages
        while True:
            stats = ray.get(server.controller.stats.remote())
            written = sum(s.tiers.store_writes for s in stats if s.role is Role.DECODE)
            if written >= 7:
                break
            assert time.monotonic() < deadline, stats
            time.sleep(0.1)
        (second,) = server.generate([turn], [sampling])
        assert second.token_ids == want.token_ids
        by_tier = second.bill.cached_tokens_by_tier
        # the prompt's 5 pages on the prefill rank's device, the answer's 2 from the write-back
        # (or, on a loaded machine, a store answer later than recomputing them: a counted miss)
        stats = ray.get(server.controller.stats.remote())
        slow = sum(s.tiers.store_slow + s.tiers.recomputed_tokens for s in stats if s.role is Role.PREFILL)
        assert by_tier.device == 5 * PAGE and (by_tier.store == 2 * PAGE or slow > 0), (by_tier, slow)
        ray.get(server.controller.check_integrity.remote())
    finally:
        server.stop()
