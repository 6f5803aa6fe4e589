"""Speculative decoding on a decode worker fed by a prefill worker over real NIXL, in one
process: with prompt-lookup or MTP drafts and K in {1, 3, 5}, greedy and seeded requests give exactly
the tokens they give with speculation off (the colocated engine, itself checked against
``transformers``), drafts are really accepted, a pool too small for every request preempts and
still matches, and every page is free and accounted for at the end."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tandem.bench.gpu_transfer_check import DirectDispatcher
from tandem.decode.decode_request import Routing
from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.types import DecodeSchedulerConfig
from tandem.decode.worker import DecodeWorker
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.drafters import make_drafter
from tandem.engine.engine_config import EngineConfig
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.engine.speculation import SpeculativeConfig
from tandem.kvtransfer.metadata import InMemoryMetadataStore
from tandem.kvtransfer.nixl_transport import NixlTransport
from tandem.model.attention_metadata import AttentionMetadata
from tandem.model.checkpoint import load_checkpoint
from tandem.model.config import ModelConfig
from tandem.model.deepseek import DeepseekV3
from tandem.model.kv_pool import KVPool
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.model.tokenizer import Tokenizer
from tandem.model.train_demo import DEMO_DIR
from tandem.prefill.scheduler import PrefillScheduler, PrefillSchedulerConfig
from tandem.prefill.worker import PrefillWorker
from tandem.wire.messages import RankId, RequestResult
from tandem.wire.request_params import SamplingParams

PAGE = 8
PREFILL, DECODE = RankId("prefill", 0), RankId("decode", 0)
EOS = 257


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny() -> Path:
    """The demo model: the tiny configuration trained on English, so its text repeats itself
    as real text does and lookup drafts are accepted (a random model's never are)."""
    return DEMO_DIR


def _model(path: Path, mtp: bool = False) -> DeepseekV3:
    cfg = ModelConfig.from_dir(path)
    model = DeepseekV3(cfg, torch.float64, mtp=mtp)
    model.load_weights(load_checkpoint(path, cfg, torch.float64, mtp=mtp))
    return model


def _workers(tiny: Path, decode_pages: int, spec: SpeculativeConfig) -> tuple[PrefillWorker, DecodeWorker]:
    store = InMemoryMetadataStore()
    mtp = spec.enabled and spec.drafter == "mtp"
    p_model, d_model = _model(tiny, mtp), _model(tiny, mtp)
    cfg = p_model.cfg
    p_pool = KVPool(cfg, 64, PAGE, torch.float64, num_layers=p_model.num_kv_layers)
    d_pool = KVPool(cfg, decode_pages, PAGE, torch.float64, num_layers=d_model.num_kv_layers)
    prefill = PrefillWorker(
        PREFILL,
        1,
        PrefillScheduler(
            PrefillSchedulerConfig(
                num_pages=64, page_size=PAGE, max_num_batched_tokens=64, max_model_len=512,
                vocab_size=cfg.vocab_size,
            )
        ),
        ModelRunner(p_model, p_pool, mtp_prefill=mtp),
        NixlTransport(PREFILL.name, 1, p_pool.layout, store),
    )  # fmt: skip
    decode = DecodeWorker(
        DECODE,
        1,
        DecodeScheduler(DecodeSchedulerConfig(num_pages=decode_pages, page_size=PAGE, max_model_len=512)),
        ModelRunner(d_model, d_pool, keep_hidden=mtp),
        NixlTransport(DECODE.name, 1, d_pool.layout, store),
        DirectDispatcher(prefill),
        speculative=spec,
        drafter=make_drafter(spec, model=d_model, pool=d_pool) if spec.enabled else None,
    )
    return prefill, decode


def _run(prefill: PrefillWorker, decode: DecodeWorker, requests: list[Request]) -> dict[str, RequestResult]:
    decode.submit([(r, Routing(), time.monotonic()) for r in requests])
    done: dict[str, RequestResult] = {}
    deadline = time.monotonic() + 120.0
    while time.monotonic() < deadline:
        decode.tick()
        prefill.tick()
        if prefill.has_work():
            prefill.step()
        decode.step()
        decode.scheduler.check_integrity()  # after every step: no page lost to a rejected draft
        done |= {r.request_id: r for r in decode.take_results()}
        if len(done) == len(requests) and not prefill.pending() and decode.transport.in_flight() == (0, 0):
            break
    assert len(done) == len(requests)
    return done


TEXTS = [
    "The river runs past the mill. The river runs past the mill and the",
    "Once upon a time there was a king who had three daughters. Once upon a time",
    "def add(a, b):\n    return a + b\n\ndef add(",
    "She said that she would come back, and she",
    "A B C D A B C D A B",
]


def _cases() -> tuple[list[list[int]], list[SamplingParams]]:
    tokenizer = Tokenizer.from_dir(DEMO_DIR)
    prompts = [tokenizer.encode(t) for t in TEXTS]
    rng = random.Random(3)
    prompts.append([rng.randrange(256) for _ in range(12)])  # no text: lookup rarely drafts
    sampling = [
        SamplingParams(max_tokens=24, ignore_eos=True) if i % 2 == 0 else
        SamplingParams(max_tokens=24, temperature=0.7, top_k=20, seed=7 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]  # fmt: skip
    prompts.append(prompts[0])
    sampling.append(SamplingParams(max_tokens=2, ignore_eos=True))  # max_tokens below K
    prompts.append(prompts[1])
    sampling.append(SamplingParams(max_tokens=40))  # may stop at EOS within a step's tokens
    # penalties: a verify row reads the drafts before it, a re-prefill its outputs so far
    prompts.append(prompts[0])
    sampling.append(
        SamplingParams(max_tokens=24, ignore_eos=True, repetition_penalty=1.3, frequency_penalty=0.5)
    )
    prompts.append(prompts[2])
    sampling.append(
        SamplingParams(
            max_tokens=24, temperature=0.8, seed=3, presence_penalty=0.8, min_p=0.1, ignore_eos=True
        )
    )
    return prompts, sampling


@pytest.fixture(scope="module")
def expected(tiny: Path) -> list[list[int]]:
    prompts, sampling = _cases()
    engine = ColocatedEngine(_model(tiny), EngineConfig(page_size=PAGE, num_pages=256))
    return [o.token_ids for o in engine.generate(prompts, sampling)]


@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_speculation_gives_the_tokens_of_plain_decoding(
    tiny: Path, expected: list[list[int]], k: int, drafter: str
) -> None:
    prompts, sampling = _cases()
    # 20 pages of 8 tokens: fewer than every request needs at once, so the pool preempts
    prefill, decode = _workers(tiny, decode_pages=20, spec=SpeculativeConfig(num_tokens=k, drafter=drafter))
    requests = [
        Request(f"r{i}", p, s, frozenset({EOS}), 512)
        for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))
    ]
    done = _run(prefill, decode, requests)
    assert [list(done[f"r{i}"].token_ids) for i in range(len(prompts))] == expected
    spec = decode.speculation
    assert spec.accepted_tokens > 0 and spec.draft_tokens > spec.accepted_tokens  # real drafts, some wrong
    if drafter == "mtp":  # the demo model's trained MTP layer: most of its first drafts are right
        assert spec.acceptance_length > 1 + 0.4 * min(k, 2), spec
    for i in range(len(prompts)):
        bill = done[f"r{i}"].bill
        s = bill.speculation
        # every output but the first (prefill's) came from a decode step, preempted or not
        assert s.steps + s.accepted_tokens == bill.output_tokens - 1
        assert s.accepted_tokens <= s.draft_tokens <= k * s.steps
        assert len(bill.token_times_s) == bill.output_tokens
    assert (
        sum(done[f"r{i}"].bill.speculation.accepted_tokens for i in range(len(prompts)))
        == spec.accepted_tokens
    )
    assert max(done[f"r{i}"].bill.preemptions for i in range(len(prompts))) > 0
    decode.scheduler.check_integrity()
    prefill.scheduler.check_integrity()
    assert decode.scheduler.num_free_pages == 20 and prefill.scheduler.num_free_pages == 64
    prefill.transport.close()
    decode.transport.close()


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mtp") / "tiny", seed=0, num_nextn_predict_layers=1)


@pytest.mark.parametrize("k", [1, 3, 5])
def test_mtp_drafts_are_the_mtp_layers_own_predictions_and_tokens_stay_exact(tiny_mtp: Path, k: int) -> None:
    """With MTP drafts the tokens are plain decoding's; and every first draft of a step is what
    the MTP layer predicts when run over the whole sequence at once (a fresh pool, the target's
    hidden states of one forward): so the prefill rank's MTP KV, the hidden state it sent, and
    each step's MTP rows on the decode rank are the right ones, through chunked prefill (chunks
    of 64) and preemption."""
    prompts, _ = _cases()
    prompts = [p * 2 for p in prompts[:6]]  # some longer than one prefill chunk
    sampling = [SamplingParams(max_tokens=16, ignore_eos=True) for _ in prompts]
    engine = ColocatedEngine(_model(tiny_mtp), EngineConfig(page_size=PAGE, num_pages=256))
    expected = [o.token_ids for o in engine.generate(prompts, sampling)]
    prefill, decode = _workers(tiny_mtp, decode_pages=24, spec=SpeculativeConfig(num_tokens=k, drafter="mtp"))
    seen: dict[tuple[str, int], int] = {}  # (request, output index) -> its first draft
    propose = decode.drafter.propose  # type: ignore[union-attr]

    def recording(requests: list[Request], room: dict[str, int]) -> dict[str, tuple[int, ...]]:
        drafts = propose(requests, room)
        for r in requests:
            if drafts.get(r.request_id):
                seen[(r.request_id, len(r.output_token_ids))] = drafts[r.request_id][0]
        return drafts

    decode.drafter.propose = recording  # type: ignore[union-attr, method-assign]
    requests = [
        Request(f"m{i}", p, s, frozenset(), 512)
        for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))
    ]
    done = _run(prefill, decode, requests)
    assert [list(done[f"m{i}"].token_ids) for i in range(len(prompts))] == expected
    assert max(done[f"m{i}"].bill.preemptions for i in range(len(prompts))) > 0

    model = _model(tiny_mtp, mtp=True)
    checked = 0
    for i, (prompt, outputs) in enumerate(zip(prompts, expected, strict=True)):
        tokens = prompt + outputs
        n = len(tokens)
        pool = KVPool(model.cfg, 64, PAGE, torch.float64, num_layers=model.num_kv_layers)
        pages = list(range(-(-n // PAGE)))
        meta = AttentionMetadata.build(PAGE, [n], [n], [pages])
        hidden = model.forward(torch.tensor(tokens), torch.arange(n), meta, pool)
        meta = AttentionMetadata.build(PAGE, [n - 1], [n - 1], [pages])
        g = model.mtp_forward(torch.tensor(tokens[1:]), torch.arange(n - 1), hidden[:-1], meta, pool)
        predicted = model.mtp_logits(g).argmax(-1).tolist()  # row p predicts the token at p + 2
        for (rid, o), draft in seen.items():
            if rid == f"m{i}":
                assert draft == predicted[len(prompt) + o - 2], (rid, o)
                checked += 1
    assert checked >= len(prompts) * 10
    decode.scheduler.check_integrity()
    assert decode.scheduler.num_free_pages == 24 and prefill.scheduler.num_free_pages == 64
    prefill.transport.close()
    decode.transport.close()


def test_aborts_at_every_stage_of_a_speculating_step_free_every_page(tiny: Path) -> None:
    """With MTP drafts (K=3): requests aborted while queued, while their KV is on its way,
    between steps, and in the middle of a verify step (after the drafts took their pages, before
    the tokens come back) all end as aborts; every page is free, page accounting holds after
    every step, and the drafter keeps nothing of them."""
    prefill, decode = _workers(tiny, decode_pages=40, spec=SpeculativeConfig(num_tokens=3, drafter="mtp"))
    tokenizer = Tokenizer.from_dir(DEMO_DIR)
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    requests = [
        Request(f"a{i}", tokenizer.encode(TEXTS[i % len(TEXTS)]), long, frozenset(), 512) for i in range(6)
    ]
    decode.submit([(r, Routing(), time.monotonic()) for r in requests])
    verify = decode.runner.verify
    mid_step: list[str] = []

    def verify_then_abort(plan: object, *args: object) -> dict[str, tuple[int, ...]]:
        out = verify(plan, *args)  # type: ignore[arg-type]
        drafting = [c for c in plan.chunks if c.draft_token_ids]  # type: ignore[attr-defined]
        if drafting and not mid_step:
            mid_step.append(drafting[-1].request_id)
            decode.abort(drafting[-1].request_id)  # its chunk is computed: update must skip it
        return out

    decode.runner.verify = verify_then_abort  # type: ignore[method-assign]
    decode.tick()
    decode.abort("a5")  # queued or waiting for its KV
    done: dict[str, RequestResult] = {}
    for step in range(3000):
        decode.tick()
        prefill.tick()
        if prefill.has_work():
            prefill.step()
        decode.step()
        decode.scheduler.check_integrity()
        if step == 12:
            decode.abort("a0")  # running, between steps
        done |= {r.request_id: r for r in decode.take_results()}
        if len(done) == 6 and not prefill.pending() and decode.transport.in_flight() == (0, 0):
            break
    assert mid_step and {done[r].finish_reason for r in ("a0", "a5", mid_step[0])} == {"abort"}
    assert all(done[r].finish_reason in ("abort", "length") for r in done)
    assert decode.scheduler.num_free_pages == 40 and prefill.scheduler.num_free_pages == 64
    assert not decode.drafter._pending and not decode.drafter._drafting  # type: ignore[union-attr]
    prefill.transport.close()
    decode.transport.close()
