"""A guided request whose grammar compiles slowly holds up no step: a prefill and a decode
worker joined by real NIXL transfers (as ``test_disagg_workers``), one rank's compiler held
back. While it is held, the other requests keep stepping (each step quick) and the guided one
waits, on the decode rank with its KV arrived, on the prefill rank before its first chunk; once
released it joins and ends under its grammar. A grammar past the rank's limit ends its request
with the error, its pages freed, and the others finish."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import torch

from tandem.decode.worker import DecodeWorker
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.colocated_worker import ColocatedWorker
from tandem.engine.engine_config import EngineConfig
from tandem.engine.request import Request, RequestStatus
from tandem.model.grammar import GuidedRows
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.model.tokenizer import Tokenizer
from tandem.prefill.worker import PrefillWorker
from tandem.wire.messages import RankId, RankRequest, RequestResult
from tandem.wire.request_params import Guide, GuideKind, SamplingParams
from tests.integration.test_disagg_workers import PAGE, _model, _submit, _workers
from tests.model.grammar_doubles import HeldCompiler

GUIDE = Guide(GuideKind.REGEX, "(yes|no)")
STEP_S = 2.5  # a tiny model's step: milliseconds (more on a loaded machine); one waiting on a compile: 8 s
EOS = 257


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("guided") / "tiny", seed=0)


def _held_rows(tiny: Path, vocab_size: int, **limits: Any) -> tuple[GuidedRows, HeldCompiler]:
    """Matchers whose compiler holds ``GUIDE``'s compile back (``limits``: ``HeldCompiler``'s)."""
    tokenizer = Tokenizer.from_dir(tiny)
    compiler = HeldCompiler(tokenizer, vocab_size, held={GUIDE}, **limits)
    return GuidedRows(compiler, tokenizer.eos_token_id), compiler


def _requests() -> list[Request]:
    free = SamplingParams(max_tokens=150, ignore_eos=True)
    guided = SamplingParams(max_tokens=10, temperature=1.0, seed=3, guide=GUIDE)
    prompt = [5, 17, 42, 9, 101, 77, 3, 64, 12, 200, 31]
    return [
        Request("g", prompt, guided, frozenset({EOS}), 512),
        Request("a", prompt[:7], free, frozenset({EOS}), 512),
        Request("b", prompt[:9], free, frozenset({EOS}), 512),
    ]


class _Loop:
    """Both workers stepped as their rank loops do, each step checked to be quick."""

    def __init__(self, prefill: PrefillWorker, decode: DecodeWorker) -> None:
        self.prefill, self.decode = prefill, decode
        self.done: dict[str, RequestResult] = {}
        self.decode_steps = 0

    def run(self, until: Callable[[], bool], timeout_s: float = 30.0) -> None:
        prefill, decode = self.prefill, self.decode
        deadline = time.monotonic() + timeout_s
        while not until():
            assert time.monotonic() < deadline, "not within the timeout"
            decode.tick()
            prefill.tick()
            for worker in (prefill, decode):
                if worker is decode or prefill.has_work():
                    start = time.perf_counter()
                    worker.step()
                    took = time.perf_counter() - start
                    assert took < STEP_S, f"a {type(worker).__name__} step took {took:.2f} s"
            self.decode_steps += 1
            self.done |= {r.request_id: r for r in decode.take_results()}

    def outputs(self, request_id: str) -> int:
        request = self.decode.scheduler.get(request_id)
        return len(request.output_token_ids) if request is not None else -1

    def close(self) -> None:
        assert self.decode.scheduler.num_free_pages == self.decode.scheduler.config.num_pages
        self.decode.scheduler.check_integrity()
        self.prefill.scheduler.check_integrity()
        self.prefill.transport.close()
        self.decode.transport.close()


def _check_guided_result(tiny: Path, result: RequestResult) -> None:
    text = Tokenizer.from_dir(tiny).decode([t for t in result.token_ids if t != EOS])
    assert text in ("yes", "no") and result.finish_reason == "stop", (text, result)


def test_a_decode_rank_decodes_the_others_while_a_grammar_compiles(tiny: Path) -> None:
    prefill, decode = _workers(tiny, decode_pages=64, layerwise=True, guided=True)
    rows, compiler = _held_rows(tiny, prefill.runner.model.cfg.vocab_size, max_hold_s=8.0)
    decode.runner.guides = rows  # the prefill rank's compiles at once: the KV arrives first
    _submit(decode, _requests())
    loop = _Loop(prefill, decode)
    loop.run(lambda: decode.scheduler.status("g") is RequestStatus.RUNNING)
    before, steps = loop.outputs("a"), loop.decode_steps
    loop.run(lambda: loop.decode_steps >= steps + 20)
    assert loop.outputs("a") >= before + 20  # the batch went on, a token a step
    assert loop.outputs("g") == 1  # the first token (the prefill rank's), no more
    assert decode.scheduler.status("g") is RequestStatus.RUNNING  # its KV kept
    compiler.release.set()
    loop.run(lambda: len(loop.done) == 3)
    _check_guided_result(tiny, loop.done["g"])
    assert loop.done["a"].finish_reason == loop.done["b"].finish_reason == "length"
    loop.close()


def test_a_prefill_rank_prefills_the_jobs_behind_a_grammar_that_compiles(tiny: Path) -> None:
    prefill, decode = _workers(tiny, decode_pages=64, layerwise=True, guided=True)
    rows, compiler = _held_rows(tiny, prefill.runner.model.cfg.vocab_size, max_hold_s=8.0)
    prefill.runner.guides = rows
    _submit(decode, _requests())  # "g" first: its job reaches the prefill rank first
    loop = _Loop(prefill, decode)
    loop.run(lambda: loop.outputs("a") > 5 and loop.outputs("b") > 5)
    assert decode.scheduler.status("g") is RequestStatus.WAITING_FOR_KV
    assert prefill.scheduler.status("g#0") is None and prefill.pending() == 1  # held: no page
    compiler.release.set()
    loop.run(lambda: len(loop.done) == 3)
    _check_guided_result(tiny, loop.done["g"])
    loop.close()


def test_a_grammar_past_the_ranks_limit_ends_its_request_and_frees_its_pages(tiny: Path) -> None:
    prefill, decode = _workers(tiny, decode_pages=64, layerwise=True, guided=True)
    vocab = prefill.runner.model.cfg.vocab_size
    rows, compiler = _held_rows(tiny, vocab, max_hold_s=30.0, time_limit_s=0.3)
    decode.runner.guides = rows
    _submit(decode, _requests())
    loop = _Loop(prefill, decode)
    loop.run(lambda: len(loop.done) == 3)
    result = loop.done["g"]
    assert result.finish_reason == "error" and result.error is not None
    assert result.error.startswith("guide: ") and "within the limit of 0.3 s" in result.error
    assert loop.done["a"].finish_reason == loop.done["b"].finish_reason == "length"
    compiler.release.set()
    loop.close()


def test_a_colocated_rank_steps_the_others_while_a_grammar_compiles(tiny: Path) -> None:
    """A colocated (DEP) rank: the guided request joins the scheduler once its grammar is ready."""
    model = _model(tiny)
    rows, compiler = _held_rows(tiny, model.cfg.vocab_size, max_hold_s=8.0)
    engine = ColocatedEngine(
        model, EngineConfig(page_size=PAGE, num_pages=64), Tokenizer.from_dir(tiny), guides=rows
    )
    worker = ColocatedWorker(RankId("colocated", 0), 1, engine, cast(Any, None))
    items = [RankRequest(r.request_id, tuple(r.prompt_token_ids), r.sampling) for r in _requests()]
    worker.submit(worker.admit(items))
    done: dict[str, RequestResult] = {}

    def run(until: Callable[[], bool]) -> None:
        deadline = time.monotonic() + 30.0
        while not until():
            assert time.monotonic() < deadline, "not within the timeout"
            worker.tick()
            if worker.has_work():
                start = time.perf_counter()
                worker.step()
                took = time.perf_counter() - start
                assert took < STEP_S, f"a colocated step took {took:.2f} s"
            done.update({r.request_id: r for r in worker.take_results()})

    def outputs(request_id: str) -> int:
        request = engine.scheduler.get_request(request_id)
        return len(request.output_token_ids) if request is not None else -1

    run(lambda: outputs("a") > 20)
    assert engine.scheduler.get_request("g") is None and "g" not in done  # held, nothing taken
    compiler.release.set()
    run(lambda: len(done) == 3)
    _check_guided_result(tiny, done["g"])
    assert done["a"].finish_reason == done["b"].finish_reason == "length"
    assert engine.scheduler.kv_cache.num_free_pages == 64
    engine.scheduler.check_integrity()
