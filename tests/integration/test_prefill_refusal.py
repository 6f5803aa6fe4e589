"""A prefill rank answers each job at once, taken or refused with why, and the decode rank that
sent a refused job frees the pages it reserved for it at once (not at its KV deadline), then
handles the request as a failed prefill: retried, and ended with the refusal once its retries are
spent. A prefill worker and a decode worker joined by real NIXL transports, in one process; the
answers go back to the decode worker as its rank's loop hands them (``prefill_answered``)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem.decode.decode_request import Routing
from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.types import DecodeSchedulerConfig
from tandem.decode.worker import DecodeWorker, PrefillDispatcher
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.kvtransfer.metadata import InMemoryMetadataStore
from tandem.kvtransfer.nixl_transport import NixlTransport
from tandem.model.checkpoint import load_checkpoint
from tandem.model.config import ModelConfig
from tandem.model.deepseek import DeepseekV3
from tandem.model.kv_pool import KVPool
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.prefill.scheduler import PrefillScheduler, PrefillSchedulerConfig
from tandem.prefill.worker import PrefillWorker
from tandem.wire.messages import RankId, RequestResult
from tandem.wire.prefill_job import PrefillJob, PrefillJobAnswer
from tandem.wire.request_params import SamplingParams
from tests.kvtransfer.transfer_doubles import wait_until

PAGE = 8
DECODE_PAGES = 32
PREFILL, DECODE = RankId("prefill", 0), RankId("decode", 0)
KV_TIMEOUT_S = 30.0  # far past the one second a refusal is given to free its pages


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("refusal") / "tiny", seed=0)


class _AnsweringDispatcher(PrefillDispatcher):
    """Every job to one prefill worker in this process; its answers wait here until the decode
    rank's loop takes them (``deliver``), as they would on its inbox."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker
        self.answers: list[PrefillJobAnswer] = []

    def choose(self, request: Request, preferred: RankId | None = None) -> RankId:
        return PREFILL

    def send(self, prefill_rank: RankId, job: PrefillJob) -> None:
        self.answers += self.worker.submit(self.worker.admit([job]))

    def set_ranks(self, ranks: dict[RankId, object]) -> None:
        raise AssertionError("one prefill rank")

    def deliver(self, decode: DecodeWorker) -> None:
        answers, self.answers = self.answers, []
        for answer in answers:
            decode.prefill_answered(answer)


def _model(path: Path) -> DeepseekV3:
    cfg = ModelConfig.from_dir(path)
    model = DeepseekV3(cfg, torch.float64)
    model.load_weights(load_checkpoint(path, cfg, torch.float64))
    return model


def _workers(
    tiny: Path, prefill_pages: int, max_jobs: int | None
) -> tuple[PrefillWorker, DecodeWorker, _AnsweringDispatcher]:
    store = InMemoryMetadataStore()
    p_model, d_model = _model(tiny), _model(tiny)
    cfg = p_model.cfg
    p_pool = KVPool(cfg, prefill_pages, PAGE, torch.float64)
    d_pool = KVPool(cfg, DECODE_PAGES, PAGE, torch.float64)
    prefill = PrefillWorker(
        PREFILL,
        1,
        PrefillScheduler(
            PrefillSchedulerConfig(
                num_pages=prefill_pages,
                page_size=PAGE,
                max_num_batched_tokens=64,
                max_model_len=512,
                vocab_size=cfg.vocab_size,
            )
        ),
        ModelRunner(p_model, p_pool),
        NixlTransport(PREFILL.name, 1, p_pool.layout, store),
        model_config=cfg,
        max_jobs=max_jobs,
    )
    dispatcher = _AnsweringDispatcher(prefill)
    decode = DecodeWorker(
        DECODE,
        1,
        DecodeScheduler(
            DecodeSchedulerConfig(
                num_pages=DECODE_PAGES, page_size=PAGE, max_model_len=512, kv_wait_timeout_s=KV_TIMEOUT_S
            )
        ),
        ModelRunner(d_model, d_pool),
        NixlTransport(DECODE.name, 1, d_pool.layout, store, abort_grace_s=KV_TIMEOUT_S),
        dispatcher,
        kv_timeout_s=KV_TIMEOUT_S,
    )
    return prefill, decode, dispatcher


def _request(request_id: str, prompt_tokens: int) -> Request:
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    return Request(request_id, [3 + i % 200 for i in range(prompt_tokens)], sampling, frozenset({257}), 512)


def _close(prefill: PrefillWorker, decode: DecodeWorker) -> None:
    prefill.transport.close()
    decode.transport.close()


def test_a_full_prefill_rank_refuses_and_the_decode_rank_frees_its_reservation_at_once(tiny: Path) -> None:
    prefill, decode, dispatcher = _workers(tiny, prefill_pages=64, max_jobs=1)
    results: dict[str, RequestResult] = {}

    def loop_iteration(step_prefill: bool) -> None:
        decode.tick()
        dispatcher.deliver(decode)  # the answers that came in, as the rank's inbox hands them
        prefill.tick()
        if step_prefill and prefill.has_work():
            prefill.step()
        decode.step()
        results.update((r.request_id, r) for r in decode.take_results())

    held = _request("held", 20)  # 3 pages; the prefill rank takes it and, not stepping, holds it
    decode.submit([(held, Routing(), time.monotonic())])
    loop_iteration(step_prefill=False)
    assert prefill.pending() == 1 and decode.scheduler.num_waiting_for_kv == 1
    held_free = decode.scheduler.num_free_pages
    assert held_free == DECODE_PAGES - 3

    refused = _request("refused", 30)  # 4 pages, reserved and sent to the full rank
    decode.submit([(refused, Routing(), time.monotonic())])
    wait_until(
        lambda: "refused" in results and decode.scheduler.num_free_pages == held_free,
        timeout_s=1.0,
        step=lambda: loop_iteration(step_prefill=False),
    )
    result = results["refused"]
    assert result.finish_reason == "error"
    assert result.error is not None and "refused the job" in result.error and "is full" in result.error
    assert "gave up after 1 retries" in result.error  # retried once, as a failed prefill is
    attempts = result.bill.attempts
    assert len(attempts) == 2 and all(a.error and "refused" in a.error and not a.delivered for a in attempts)
    assert prefill.refused_jobs == 2 and prefill.pending() == 1
    decode.scheduler.check_integrity()

    # the held job runs; then every page of both sides is free and no transfer is left waiting
    wait_until(
        lambda: "held" in results and decode.transport.in_flight() == (0, 0) and not prefill.pending(),
        timeout_s=30.0,
        step=lambda: loop_iteration(step_prefill=True),
    )
    assert results["held"].finish_reason == "length" and len(results["held"].token_ids) == 4
    decode.scheduler.check_integrity()
    prefill.scheduler.check_integrity()
    assert decode.scheduler.num_free_pages == DECODE_PAGES
    assert prefill.transport.in_flight() == (0, 0)
    _close(prefill, decode)


def test_a_job_too_long_for_the_prefill_pool_is_refused_at_once(tiny: Path) -> None:
    prefill, decode, dispatcher = _workers(tiny, prefill_pages=4, max_jobs=None)  # 32 tokens at most
    results: dict[str, RequestResult] = {}

    def loop_iteration() -> None:
        decode.tick()
        dispatcher.deliver(decode)
        prefill.tick()
        decode.step()
        results.update((r.request_id, r) for r in decode.take_results())

    decode.submit([(_request("long", 40), Routing(), time.monotonic())])  # 5 pages
    wait_until(
        lambda: "long" in results and decode.scheduler.num_free_pages == DECODE_PAGES,
        timeout_s=1.0,
        step=loop_iteration,
    )
    error = results["long"].error
    assert error is not None and "pool has only 4" in error
    assert not prefill.pending() and prefill.scheduler.num_free_pages == 4
    wait_until(lambda: decode.transport.in_flight() == (0, 0), timeout_s=10.0, step=loop_iteration)
    decode.scheduler.check_integrity()
    _close(prefill, decode)
