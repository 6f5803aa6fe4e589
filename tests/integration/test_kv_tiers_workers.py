"""Two prefill workers and a decode worker joined by real NIXL transfers, with every KV tier on:
a host tier per prefill rank and a real Mooncake store (``mooncake_master`` on loopback). A
prefix evicted from the device comes back from the host; one computed on one prefill rank is
read from the store by the other; a second turn (prompt + the first answer + new text) finds
the answer's blocks in the store (the decode rank wrote them back); a corrupt block is a counted
miss; the master stopped mid-run loses no request. Greedy tokens equal ``transformers``'
(float64 on both sides); every bill says which tier each cached token came from."""

from __future__ import annotations

import copy
import os
import random
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.cluster.kv_store_master import StoreMaster
from tandem.decode.decode_request import Routing
from tandem.decode.dispatch import PrefillDispatcher
from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.types import DecodeSchedulerConfig
from tandem.decode.worker import DecodeWorker
from tandem.engine.kv_block_codec import StoredBlock, encode_block
from tandem.engine.kv_tiers import TierConfig, TierPrices
from tandem.engine.prefix_cache import block_hashes
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.engine.tier_copier import TierCopier, build_tiers, page_bytes, pool_block_layout
from tandem.kvtransfer.kv_store import StoreConfig
from tandem.kvtransfer.metadata import InMemoryMetadataStore
from tandem.kvtransfer.mooncake_store import MooncakeStore
from tandem.kvtransfer.nixl_transport import NixlTransport
from tandem.model.checkpoint import load_checkpoint
from tandem.model.config import ModelConfig
from tandem.model.deepseek import DeepseekV3
from tandem.model.kv_pool import KVPool
from tandem.prefill.scheduler import PrefillScheduler, PrefillSchedulerConfig
from tandem.prefill.worker import PrefillWorker
from tandem.wire.messages import RankId, RequestResult
from tandem.wire.prefill_job import PrefillJob
from tandem.wire.request_params import SamplingParams
from tests.hf_reference import make_hf_checkpoint

PAGE = 8
DEVICE_PAGES = 10  # a prefill rank's device pool: small, so prefixes are evicted
HOST_PAGES = 64
A, B, DECODE = RankId("prefill-a", 0), RankId("prefill-b", 0), RankId("decode", 0)
MODEL_KEY = "tiny-hf"
MAX_TOKENS = 6


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp("tiers") / "hf"
    hf = make_hf_checkpoint(path, seed=7)
    hf64 = copy.deepcopy(hf).to(torch.float64)
    hf64.config._attn_implementation = "sdpa"
    hf64.config._experts_implementation = "eager"
    return path, hf64


def _golden(hf: Any, prompt: list[int]) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False, top_k=None, top_p=None
    )
    return out[0, len(prompt) :].tolist()


def _model(path: Path) -> DeepseekV3:
    cfg = ModelConfig.from_dir(path)
    model = DeepseekV3(cfg, torch.float64)
    model.load_weights(load_checkpoint(path, cfg, torch.float64))
    return model


class _To(PrefillDispatcher):
    """Every job to the prefill worker the test names (``target``), in this process."""

    def __init__(self, workers: dict[RankId, PrefillWorker]) -> None:
        self.workers, self.target = workers, A

    def choose(self, request: Request, preferred: RankId | None = None) -> RankId:
        return self.target

    def send(self, prefill_rank: RankId, job: PrefillJob) -> None:
        self.workers[prefill_rank].submit([(job, time.monotonic())])

    def set_ranks(self, ranks: dict[RankId, object]) -> None:
        raise AssertionError("fixed ranks")


SECRET = b"the test deployment's store secret"


class _SlowPrefill(TierPrices):
    """Recomputing priced at 100 tokens/s whatever the tiny model's forward measures: a store
    answer on a loaded machine is never slower than that, so a miss here is a real one."""

    def __init__(self) -> None:
        super().__init__(prefill_tokens_per_s=100.0)

    def observe(self, what: str, amount: float, seconds: float) -> None:
        if what != "prefill":
            super().observe(what, amount, seconds)


def _tiers(pool: KVPool, store: StoreConfig, host_pages: int) -> TierCopier:
    config = TierConfig(
        host_pages=host_pages,
        store=MooncakeStore(store),
        model=MODEL_KEY,
        layout=pool_block_layout(pool),
        page_bytes=page_bytes(pool),
        store_retry_s=0.5,
        store_timeout_s=30.0,  # a loaded 2-core machine must not turn a slow answer into a miss here
        prices=_SlowPrefill(),
        secret=SECRET,
    )
    return build_tiers(pool, config)[1]


class _Cluster:
    def __init__(self, path: Path, store: StoreConfig) -> None:
        metadata = InMemoryMetadataStore()
        self.prefill: dict[RankId, PrefillWorker] = {}
        for rank in (A, B):
            model = _model(path)
            pool = KVPool(model.cfg, DEVICE_PAGES, PAGE, torch.float64)
            copier = _tiers(pool, store, HOST_PAGES)
            config = PrefillSchedulerConfig(
                num_pages=DEVICE_PAGES, page_size=PAGE, max_num_batched_tokens=64, max_model_len=512
            )
            self.prefill[rank] = PrefillWorker(
                rank,
                1,
                PrefillScheduler(config, copier.tiers),
                ModelRunner(model, pool),
                NixlTransport(rank.name, 1, pool.layout, metadata),
                copier=copier,
            )
        model = _model(path)
        pool = KVPool(model.cfg, 64, PAGE, torch.float64)
        self.dispatcher = _To(self.prefill)
        self.decode = DecodeWorker(
            DECODE,
            1,
            DecodeScheduler(DecodeSchedulerConfig(num_pages=64, page_size=PAGE, max_model_len=512)),
            ModelRunner(model, pool),
            NixlTransport(DECODE.name, 1, pool.layout, metadata),
            self.dispatcher,
            writeback=_tiers(pool, store, 0),
        )
        self._n = 0

    def run(self, prompts: list[list[int]], on: RankId) -> list[RequestResult]:
        self.dispatcher.target = on
        sampling = SamplingParams(max_tokens=MAX_TOKENS)
        ids = []
        for prompt in prompts:
            self._n += 1
            ids.append(f"r{self._n}")
            request = Request(ids[-1], prompt, sampling, frozenset({1}), 512)  # eos as transformers' config
            self.decode.submit([(request, Routing(), time.monotonic())])
        done: dict[str, RequestResult] = {}
        deadline = time.monotonic() + 60
        while len(done) < len(ids) and time.monotonic() < deadline:
            self.decode.tick()
            for worker in self.prefill.values():
                worker.tick()
                if worker.has_work():
                    worker.step()
            self.decode.step()
            done |= {r.request_id: r for r in self.decode.take_results()}
        assert len(done) == len(ids), "requests did not finish"
        self.flush()
        return [done[i] for i in ids]

    def flush(self) -> None:
        for copier in [w.copier for w in self.prefill.values()] + [self.decode.writeback]:
            assert copier is not None and copier.tiers.writer is not None
            assert copier.tiers.writer.flush()

    def check(self) -> None:
        for worker in self.prefill.values():
            worker.scheduler.check_integrity()
            assert worker.scheduler.num_free_pages == DEVICE_PAGES
        self.decode.scheduler.check_integrity()
        assert self.decode.scheduler.num_free_pages == 64

    def close(self) -> None:
        for worker in self.prefill.values():
            worker.transport.close()
            worker.close()
        self.decode.transport.close()
        self.decode.close()


@pytest.fixture
def master() -> Iterator[StoreMaster]:
    m = StoreMaster.start()
    yield m
    m.stop()


def _in_process(master: StoreMaster) -> StoreConfig:
    """The clients run in the test's process, which was not started with the bind guard: they
    listen on every interface, as a trusted network allows (the guard is tested with serve, in
    tests/integration/test_listeners.py)."""
    return StoreConfig(master.master, master.metadata, segment_bytes=16 << 20, trusted_network=True)


def _tiers_of(result: RequestResult) -> tuple[int, int, int]:
    t = result.bill.cached_tokens_by_tier
    assert t.total == result.bill.cached_tokens
    return t.device, t.host, t.store


def test_every_tier_serves_golden_tokens_and_bills_where_they_came_from(
    checkpoint: tuple[Path, Any], master: StoreMaster
) -> None:
    path, hf = checkpoint
    rng = random.Random(1)
    system = [rng.randrange(2, 300) for _ in range(5 * PAGE)]  # 40 tokens: 5 pages
    cluster = _Cluster(path, _in_process(master))
    try:
        first_prompt = system + [rng.randrange(2, 300) for _ in range(3)]
        (first,) = cluster.run([first_prompt], on=A)
        assert list(first.token_ids) == _golden(hf, first_prompt)
        assert _tiers_of(first) == (0, 0, 0)

        # two other prompts on A fill its 10 device pages: the system prompt's pages go to its host tier
        others = [[rng.randrange(2, 300) for _ in range(6 * PAGE + 1)] for _ in range(2)]
        cluster.run(others, on=A)
        again = system + [rng.randrange(2, 300) for _ in range(4)]
        (from_host,) = cluster.run([again], on=A)
        assert list(from_host.token_ids) == _golden(hf, again)
        device, host, store = _tiers_of(from_host)
        assert host >= PAGE and host + device == 5 * PAGE, (device, host, store)

        # another prefill rank, never given this prefix, reads it from the store
        other = system + [rng.randrange(2, 300) for _ in range(5)]
        (from_store,) = cluster.run([other], on=B)
        assert list(from_store.token_ids) == _golden(hf, other)
        assert _tiers_of(from_store) == (0, 0, 5 * PAGE)

        # a second turn: the first answer's KV was written back by the decode rank
        second = first_prompt + list(first.token_ids) + [rng.randrange(2, 300) for _ in range(9)]
        (turn,) = cluster.run([second], on=B)
        assert list(turn.token_ids) == _golden(hf, second)
        computed_then = len(first_prompt) + MAX_TOKENS - 1  # the last answer token's KV was never computed
        assert turn.bill.cached_tokens == computed_then // PAGE * PAGE > len(system)
        assert _tiers_of(turn)[2] >= turn.bill.cached_tokens - 5 * PAGE
        cluster.check()
        # the address the clients advertised is not left behind for the processes this one starts
        assert "MC_TCP_BIND_ADDRESS" not in os.environ
    finally:
        cluster.close()


def test_a_corrupt_block_is_a_counted_miss_and_a_stopped_master_loses_no_request(
    checkpoint: tuple[Path, Any], master: StoreMaster
) -> None:
    path, hf = checkpoint
    rng = random.Random(2)
    config = _in_process(master)
    cluster = _Cluster(path, config)
    try:
        prompt = [rng.randrange(2, 300) for _ in range(4 * PAGE + 2)]
        blocks = block_hashes(prompt, PAGE)
        pool = cluster.prefill[B].runner.pool
        layout = pool_block_layout(pool)
        # block 2 is in the store before anyone computes it, with one byte of its KV flipped
        # (the store keeps a key's first value, so A's write of the good block is a no-op)
        b_tiers = cluster.prefill[B].copier.tiers  # type: ignore[union-attr]
        key = b_tiers.key(blocks[2])
        bad = bytearray(
            encode_block(
                SECRET, StoredBlock(key, blocks[1], prompt[16:24]), MODEL_KEY, layout, bytes(page_bytes(pool))
            )
        )
        bad[-40] ^= 0xFF  # a byte of its KV
        # the block lives in this client's segment: it stays open to the end (closing it takes its
        # blocks out of the store)
        writer = MooncakeStore(config)
        writer.put(key, bytes(bad))
        cluster.run([prompt], on=A)
        (read,) = cluster.run([[*prompt, 5, 6]], on=B)
        assert list(read.token_ids) == _golden(hf, [*prompt, 5, 6])
        assert _tiers_of(read) == (0, 0, 2 * PAGE)  # blocks 0 and 1; block 2 was rejected
        assert b_tiers.store_rejected == 1

        master.stop()  # mid-run: the store is gone
        late = [rng.randrange(2, 300) for _ in range(3 * PAGE + 1)]
        results = cluster.run([[*prompt, 7], late], on=B)
        assert [list(r.token_ids) for r in results] == [_golden(hf, [*prompt, 7]), _golden(hf, late)]
        assert b_tiers.stats().store_errors >= 1
        cluster.check()
    finally:
        cluster.close()
        writer.close()
