"""A prefill worker and a decode worker joined by real NIXL transfers, in one process: the
disaggregated path gives the colocated engine's tokens, reuses prefixes, and survives a decode
pool too small for all requests at once, with every page accounted for at the end."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.types import DecodeSchedulerConfig
from tandem.decode.worker import DecodeWorker, PrefillDispatcher, Routing
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.messages import RankId, RequestResult
from tandem.engine.request import Request, SamplingParams
from tandem.engine.runner import ModelRunner
from tandem.kvtransfer.metadata import InMemoryMetadataStore
from tandem.kvtransfer.nixl_transport import NixlTransport
from tandem.kvtransfer.types import KVTransferAborted
from tandem.model.checkpoint import load_checkpoint
from tandem.model.config import ModelConfig
from tandem.model.deepseek import DeepseekV3
from tandem.model.kv_pool import KVPool
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.prefill.job import PrefillJob
from tandem.prefill.scheduler import PrefillScheduler, PrefillSchedulerConfig
from tandem.prefill.worker import PrefillWorker

PAGE = 8
PREFILL, DECODE = RankId("prefill", 0), RankId("decode", 0)


class _Direct(PrefillDispatcher):
    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    def choose(self, request: Request, preferred: RankId | None = None) -> RankId:
        return PREFILL

    def send(self, prefill_rank: RankId, job: PrefillJob) -> None:
        self.worker.submit([job])

    def set_ranks(self, ranks: dict[RankId, object]) -> None:
        raise AssertionError("a direct dispatcher has one prefill rank")


def _model(path: Path) -> DeepseekV3:
    cfg = ModelConfig.from_dir(path)
    model = DeepseekV3(cfg, torch.float64)
    model.load_weights(load_checkpoint(path, cfg, torch.float64))
    return model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("disagg") / "tiny", seed=0)


def _workers(tiny: Path, decode_pages: int, layerwise: bool) -> tuple[PrefillWorker, DecodeWorker]:
    store = InMemoryMetadataStore()
    p_model, d_model = _model(tiny), _model(tiny)
    cfg = p_model.cfg
    p_pool = KVPool(cfg, 64, PAGE, torch.float64)
    d_pool = KVPool(cfg, decode_pages, PAGE, torch.float64)
    prefill = PrefillWorker(
        PREFILL,
        1,
        PrefillScheduler(
            PrefillSchedulerConfig(
                num_pages=64,
                page_size=PAGE,
                max_num_batched_tokens=64,
                max_model_len=512,
                vocab_size=cfg.vocab_size,
            )
        ),
        ModelRunner(p_model, p_pool),
        NixlTransport(PREFILL.name, 1, p_pool.layout, store),
        layerwise=layerwise,
    )
    decode = DecodeWorker(
        DECODE,
        1,
        DecodeScheduler(DecodeSchedulerConfig(num_pages=decode_pages, page_size=PAGE, max_model_len=512)),
        ModelRunner(d_model, d_pool),
        NixlTransport(DECODE.name, 1, d_pool.layout, store),
        _Direct(prefill),
    )
    return prefill, decode


def _submit(decode: DecodeWorker, requests: list[Request]) -> None:
    decode.submit([(r, Routing()) for r in requests])


def _run(prefill: PrefillWorker, decode: DecodeWorker, requests: list[Request]) -> dict[str, RequestResult]:
    _submit(decode, requests)
    done = _drive(prefill, decode, until=len(requests), steps=5000)
    assert len(done) == len(requests)
    return done


def _requests(prompts: list[list[int]], sampling: list[SamplingParams], tag: str) -> list[Request]:
    return [
        Request(f"{tag}{i}", p, s, frozenset({257}), 512)
        for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))
    ]


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole-request"])
def test_disaggregated_tokens_equal_the_colocated_engine(tiny: Path, layerwise: bool) -> None:
    rng = random.Random(0)
    system = [rng.randrange(256) for _ in range(20)]  # a shared prefix, as a chat's system prompt
    prompts = [system + [rng.randrange(256) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    prompts += [[rng.randrange(256)] for _ in range(2)]
    sampling = [
        SamplingParams(max_tokens=12, ignore_eos=True) if i % 2 else
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]  # fmt: skip
    engine = ColocatedEngine(_model(tiny), EngineConfig(page_size=PAGE, num_pages=256))
    expected = [o.token_ids for o in engine.generate(prompts, sampling)]

    # a decode pool of 12 pages: requests wait for pages in its pre-allocation queue
    prefill, decode = _workers(tiny, decode_pages=12, layerwise=layerwise)
    first = _run(
        prefill, decode, _requests(prompts[:1], sampling[:1], "warm")
    )  # puts the prefix in the cache
    assert list(first["warm0"].token_ids) == expected[0]
    done = _run(prefill, decode, _requests(prompts, sampling, "r"))
    assert [list(done[f"r{i}"].token_ids) for i in range(len(prompts))] == expected
    for i in range(1, 6):  # the shared prefix came from the prefill rank's cache
        bill = done[f"r{i}"].bill
        assert bill.cached_tokens >= 16 and bill.new_prompt_tokens == len(prompts[i]) - bill.cached_tokens
        assert bill.kv_bytes > 0 and bill.ttft_s > 0 and len(bill.token_times_s) == bill.output_tokens == 12
        assert list(bill.token_times_s) == sorted(bill.token_times_s) and bill.token_times_s[0] == bill.ttft_s
        assert done[f"r{i}"].prefill_rank == PREFILL and done[f"r{i}"].finish_reason == "length"
    decode.scheduler.check_integrity()
    prefill.scheduler.check_integrity()
    assert decode.scheduler.num_free_pages == 12
    assert prefill.scheduler.num_free_pages == 64
    assert prefill.transport.in_flight() == (0, 0) and decode.transport.in_flight() == (0, 0)
    prefill.transport.close()
    decode.transport.close()


def _drive(
    prefill: PrefillWorker, decode: DecodeWorker, until: int, steps: int = 3000
) -> dict[str, RequestResult]:
    done: dict[str, RequestResult] = {}
    for _ in range(steps):
        decode.tick()
        prefill.tick()
        if prefill.has_work():
            prefill.step()
        decode.step()
        done |= {r.request_id: r for r in decode.take_results()}
        if len(done) >= until and not prefill.pending() and decode.transport.in_flight() == (0, 0):
            break
    return done


def test_abort_at_every_stage_frees_every_page(tiny: Path) -> None:
    prefill, decode = _workers(tiny, decode_pages=8, layerwise=True)
    long = SamplingParams(max_tokens=24, ignore_eos=True)
    # "running" holds 5 of the 8 decode pages once it decodes; "queued" (4 pages) then waits
    _submit(decode, _requests([[7] * 40], [long], "running"))
    for _ in range(3000):
        _drive(prefill, decode, until=0, steps=1)
        if decode.scheduler.num_running:
            break
    assert decode.scheduler.num_running == 1 and decode.scheduler.num_free_pages < 4
    _submit(decode, _requests([[9] * 30], [long], "queued"))
    decode.tick()
    assert decode.scheduler.num_queued == 1
    decode.abort("queued0")  # waiting for pages
    decode.abort("running0")  # decoding
    # waiting for KV: the job was sent but the prefill rank has not started it
    _submit(decode, _requests([[5] * 12], [long], "kv"))
    decode.tick()
    assert decode.scheduler.num_waiting_for_kv == 1 and prefill.pending() == 1
    decode.abort("kv0")
    done = _drive(prefill, decode, until=3)
    assert {r: done[r].finish_reason for r in ("queued0", "running0", "kv0")} == dict.fromkeys(
        ("queued0", "running0", "kv0"), "abort"
    )
    # the prefill rank never wrote into the pages the decode rank gave up
    assert prefill.failures and isinstance(prefill.failures[-1].error, KVTransferAborted)
    decode.scheduler.check_integrity()
    prefill.scheduler.check_integrity()
    assert decode.scheduler.num_free_pages == 8 and prefill.scheduler.num_free_pages == 64
    assert prefill.transport.in_flight() == (0, 0) and decode.transport.in_flight() == (0, 0)
    prefill.transport.close()
    decode.transport.close()
