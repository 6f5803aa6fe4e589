"""Tandem's model and engine against Hugging Face ``DeepseekV3ForCausalLM`` on the same checkpoints."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.model.attention_metadata import AttentionMetadata
from tandem.model.checkpoint import load_checkpoint
from tandem.model.config import ModelConfig
from tandem.model.deepseek import DeepseekV3
from tandem.model.kv_pool import KVPool
from tandem.wire.request_params import SamplingParams
from tests.hf_reference import VARIANTS, make_hf_checkpoint

GEN_TOKENS = 48


def _load(path: Path, dtype: torch.dtype) -> DeepseekV3:
    cfg = ModelConfig.from_dir(path)
    model = DeepseekV3(cfg, dtype)
    model.load_weights(load_checkpoint(path, cfg, dtype))
    return model


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    path = tmp_path_factory.mktemp(f"hf-{request.param}")
    hf = make_hf_checkpoint(path, request.param, seed=sorted(VARIANTS).index(request.param))
    return path, hf


def _rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref.double()).abs().max() / ref.double().abs().max())


def test_prefill_extend_and_decode_logits_match(checkpoint: tuple[Path, Any]) -> None:
    """Every position's logits within 1e-4 (float32), whether the position was computed in a full
    prefill, an extend over cached pages, or an absorbed single-token decode."""
    path, hf = checkpoint
    model = _load(path, torch.float32)
    page = 4
    pool = KVPool(model.cfg, 32, page, torch.float32)
    gen = torch.Generator().manual_seed(7)
    lengths = [1, page, page + 1, 23]
    prompts = [torch.randint(2, model.cfg.vocab_size, (n,), generator=gen) for n in lengths]
    refs = [hf(p[None]).logits[0].detach() for p in prompts]

    # full prefill of all but the last prompt, as one ragged batch on non-contiguous pages
    pages = [[31], [7], [3, 9], [2, 30, 4, 11, 5, 12]]
    n0 = lengths[:3]
    meta = AttentionMetadata.build(page, n0, n0, pages[:3])
    hidden = model.forward(torch.cat(prompts[:3]), torch.cat([torch.arange(n) for n in n0]), meta, pool)
    logits = model.compute_logits(hidden)
    for i, chunk in enumerate(logits.split(n0)):
        assert _rel_err(chunk, refs[i]) < 1e-4

    # the long prompt in pieces: prefill 9, extend 13 over the cached 9, then decode 1
    out = []
    for start, end in [(0, 9), (9, 22), (22, 23)]:
        meta = AttentionMetadata.build(page, [end - start], [end], [pages[3]])
        hidden = model.forward(prompts[3][start:end], torch.arange(start, end), meta, pool)
        out.append(model.compute_logits(hidden))
    assert meta.decode_rows == [0]
    assert _rel_err(torch.cat(out), refs[3]) < 1e-4


def _check_all_pages_free(engine: ColocatedEngine) -> None:
    engine.scheduler.check_integrity()
    cache = engine.scheduler.kv_cache
    assert cache.num_free_pages == cache.num_total_pages


def _hf_greedy(hf: Any, prompt: list[int]) -> list[int]:
    out = hf.generate(
        torch.tensor([prompt]), max_new_tokens=GEN_TOKENS, do_sample=False, top_k=None, top_p=None
    )
    return out[0, len(prompt) :].tolist()


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(n)] for n in (1, 5, 16, 17, 30, 33, 47, 64)]


@pytest.fixture(scope="module")
def float64_reference(checkpoint: tuple[Path, Any]) -> tuple[Path, Any, list[list[int]], list[list[int]]]:
    """Greedy generation is compared in float64 on both sides: a random tiny model has near-ties
    that float32 rounding may flip in one implementation and not the other."""
    path, hf = checkpoint
    hf64 = copy.deepcopy(hf).to(torch.float64)
    hf64.config._attn_implementation = "sdpa"
    hf64.config._experts_implementation = "eager"  # grouped_mm has no float64
    prompts = _prompts(hf.config.vocab_size, seed=3)
    return path, hf64, prompts, [_hf_greedy(hf64, p) for p in prompts]


def test_concurrent_greedy_generation_matches(float64_reference: Any) -> None:
    path, _, prompts, expected = float64_reference
    engine = ColocatedEngine(_load(path, torch.float64), EngineConfig(page_size=16, num_pages=64))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=GEN_TOKENS))
    assert [o.token_ids for o in outputs] == expected
    _check_all_pages_free(engine)


def test_greedy_generation_with_penalties_matches(float64_reference: Any) -> None:
    """Repetition, frequency and presence penalties (greedy, so only the penalties decide)
    against ``transformers``: its ``repetition_penalty`` over prompt and output, and OpenAI's two
    as a logits processor over the output, applied after it as vLLM does."""
    from transformers import LogitsProcessor, LogitsProcessorList

    path, hf, prompts, plain = float64_reference
    if not path.name.startswith("hf-qlora"):
        pytest.skip("one checkpoint variant is enough for the sampler's penalties")

    class OpenAIPenalties(LogitsProcessor):  # type: ignore[misc]
        def __init__(self, prompt_len: int) -> None:
            self.prompt_len = prompt_len

        def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
            counts = torch.bincount(input_ids[0, self.prompt_len :], minlength=scores.shape[-1])
            return scores - 0.7 * counts.to(scores.dtype) - 0.4 * (counts > 0).to(scores.dtype)

    sampling = SamplingParams(
        max_tokens=GEN_TOKENS, repetition_penalty=1.3, frequency_penalty=0.7, presence_penalty=0.4
    )
    engine = ColocatedEngine(_load(path, torch.float64), EngineConfig(page_size=16, num_pages=64))
    outputs = engine.generate(prompts, sampling)
    for prompt, out in zip(prompts, outputs, strict=True):
        ref = hf.generate(
            torch.tensor([prompt]),
            max_new_tokens=GEN_TOKENS,
            do_sample=False,
            top_k=None,
            top_p=None,
            repetition_penalty=1.3,
            logits_processor=LogitsProcessorList([OpenAIPenalties(len(prompt))]),
        )[0, len(prompt) :].tolist()
        assert out.token_ids == ref
    assert [o.token_ids for o in outputs] != plain  # the penalties changed what greedy gives
    _check_all_pages_free(engine)


def test_shared_prefixes_hit_the_cache_and_match(float64_reference: Any) -> None:
    path, hf, prompts, expected = float64_reference
    engine = ColocatedEngine(_load(path, torch.float64), EngineConfig(page_size=8, num_pages=128))
    first = engine.generate(prompts[4:], SamplingParams(max_tokens=GEN_TOKENS))
    assert [o.token_ids for o in first] == expected[4:]
    # follow-up turns: each earlier prompt + its answer + a new user turn, as multi-turn chats do
    turns = [p + o.token_ids[:10] + [5, 6, 7] for p, o in zip(prompts[4:], first, strict=True)]
    second = engine.generate(turns, SamplingParams(max_tokens=GEN_TOKENS))
    for turn, out in zip(turns, second, strict=True):
        assert out.cached_tokens > 0
        assert out.cached_tokens % 8 == 0 and out.cached_tokens < len(turn)
        assert out.token_ids == _hf_greedy(hf, turn)
    _check_all_pages_free(engine)


def test_tiny_pool_preempts_and_still_matches(float64_reference: Any) -> None:
    path, _, prompts, expected = float64_reference
    # 14 pages of 8 tokens: the longest request alone needs 14, so the batch must preempt
    engine = ColocatedEngine(
        _load(path, torch.float64), EngineConfig(page_size=8, num_pages=14, max_num_batched_tokens=64)
    )
    ids = [engine.add_request(p, SamplingParams(max_tokens=GEN_TOKENS)) for p in prompts]
    finished = {}
    while engine.scheduler.has_unfinished_requests():
        for request in engine.step():
            finished[request.request_id] = request
        engine.scheduler.check_integrity()
    assert sum(r.num_preemptions for r in finished.values()) > 0
    assert [finished[i].output_token_ids for i in ids] == expected
    _check_all_pages_free(engine)


def test_bfloat16_prefill_logits_match(checkpoint: tuple[Path, Any]) -> None:
    """bfloat16 against the reference run in bfloat16. Positions agree within a few bfloat16 ulps
    (2^-8 relative each); a position where bfloat16 rounding flips a near-tied expert choice in one
    implementation and not the other may differ more, so a few such positions are allowed."""
    path, hf = checkpoint
    model = _load(path, torch.bfloat16)
    assert model.layers[-1].mlp.gate_weight.dtype == torch.float32
    ids = torch.randint(2, model.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(5))
    ref = copy.deepcopy(hf).to(torch.bfloat16)(ids[None]).logits[0].detach().double()
    pool = KVPool(model.cfg, 8, 8, torch.bfloat16)
    meta = AttentionMetadata.build(8, [40], [40], [[6, 1, 7, 0, 2]])
    ours = model.compute_logits(model.forward(ids, torch.arange(40), meta, pool)).double()
    per_position = (ours - ref).abs().amax(-1) / ref.abs().amax(-1)
    assert (per_position < 5e-2).float().mean() >= 0.9


def _check_logprobs(entries: list[Any], tokens: list[int], ref: torch.Tensor, k: int) -> None:
    """Entry ``i`` is token ``tokens[i]`` drawn from ``ref[i]`` (log-softmax rows): its logprob
    and its ``k`` likeliest within 1e-4, in order."""
    assert len(entries) == len(tokens)
    for entry, token, row in zip(entries, tokens, ref, strict=True):
        assert entry.token_id == token
        assert abs(entry.logprob - row[token].item()) < 1e-4
        assert len(entry.top) == k
        for (top_id, top_lp), (ref_lp, ref_id) in zip(entry.top, zip(*row.topk(k), strict=True), strict=True):
            assert abs(top_lp - ref_lp.item()) < 1e-4
            assert top_id == ref_id.item() or abs(row[top_id].item() - ref_lp.item()) < 1e-4  # a tie


def test_output_and_prompt_logprobs_equal_the_log_softmax_of_the_reference(checkpoint: Any) -> None:
    """Output logprobs (sampled at temperature 1 with top-k 5: the values are the model's, before
    any sampling adjustment) and prompt logprobs equal ``transformers``' float32 log-softmax
    within 1e-4, for a prompt computed whole and for one whose prefix the cache holds (it is
    computed again: the cache keeps no logits)."""
    path, hf = checkpoint
    engine = ColocatedEngine(_load(path, torch.float32), EngineConfig(page_size=4, num_pages=64))
    rng = random.Random(11)
    prefix = [rng.randrange(2, hf.config.vocab_size) for _ in range(12)]
    first = prefix + [rng.randrange(2, hf.config.vocab_size) for _ in range(5)]
    second = prefix + [rng.randrange(2, hf.config.vocab_size) for _ in range(3)]
    engine.generate([first], SamplingParams(max_tokens=2))  # the prefix is now cached
    sampling = SamplingParams(max_tokens=6, temperature=1.0, top_k=5, seed=5, logprobs=3, prompt_logprobs=2)
    for prompt in (first, second):
        out = engine.generate([prompt], sampling)[0]
        assert out.cached_tokens == 0
        full = torch.tensor(prompt + out.token_ids)
        ref = torch.log_softmax(hf(full[None]).logits[0].detach().float(), dim=-1)
        assert out.prompt_logprobs[0] is None
        _check_logprobs(out.prompt_logprobs[1:], prompt[1:], ref[: len(prompt) - 1], 2)
        _check_logprobs(out.logprobs, out.token_ids, ref[len(prompt) - 1 : -1], 3)
    cached = engine.generate([second], SamplingParams(max_tokens=2))[0]
    assert cached.cached_tokens == 12  # without prompt logprobs the prefix is the cache's
    _check_all_pages_free(engine)
