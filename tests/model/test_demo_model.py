"""The demo model that ``serve`` and ``generate`` run without ``--model``: the committed
checkpoint (the tiny model's exact shapes, text that reads as English) and its training."""

from __future__ import annotations

import json
import math
import re
import string
from pathlib import Path

import pytest
import torch

from tandem.cluster.serve import demo_model_dir
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.model.checkpoint import check_model_dir, load_checkpoint
from tandem.model.config import expected_mtp_tensor_shapes, expected_tensor_shapes
from tandem.model.make_tiny import tiny_config_dict, write_tokenizer
from tandem.model.train_demo import (
    DEMO_CORPUS,
    DEMO_DIR,
    TrainSettings,
    corpus_split,
    held_out_bits,
    train_demo,
)
from tandem.wire.request_params import SamplingParams

PROMPT = "And God said"
ALLOWED = set(string.ascii_letters + " \n.,;:'!?-()")


def _greedy_text(model_dir: Path, tokens: int = 64) -> str:
    engine = ColocatedEngine.from_model_dir(model_dir, torch.float32, EngineConfig())
    [out] = engine.generate(
        [engine.tokenizer.encode(PROMPT)], SamplingParams(max_tokens=tokens, ignore_eos=True)
    )
    return engine.tokenizer.decode(out.token_ids)


def _english(text: str) -> tuple[float, set[str]]:
    """The fraction of characters that are letters, spaces or punctuation, and the distinct words of
    two or more letters that the corpus uses too."""
    corpus_words = set(re.findall(r"[a-z]{2,}", DEMO_CORPUS.read_text().lower()))
    allowed = sum(c in ALLOWED for c in text) / max(1, len(text))
    words = {w.lower() for w in re.findall(r"(?<![A-Za-z])[A-Za-z]{2,}(?![A-Za-z])", text)}
    return allowed, words & corpus_words


def test_serve_and_generate_default_to_the_committed_demo_checkpoint() -> None:
    assert demo_model_dir() == DEMO_DIR
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in DEMO_DIR.iterdir()
    }


def test_demo_checkpoint_has_the_tiny_models_shapes_and_tokenizer(tmp_path: Path) -> None:
    cfg = check_model_dir(DEMO_DIR, mtp=True)  # config, tokenizer and every tensor's header
    assert json.loads((DEMO_DIR / "config.json").read_text()) == tiny_config_dict(num_nextn_predict_layers=1)
    tensors = load_checkpoint(DEMO_DIR, cfg, torch.float32, mtp=True)
    want = expected_tensor_shapes(cfg) | expected_mtp_tensor_shapes(cfg)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == {n: tuple(s) for n, s in want.items()}
    assert all(t.dtype == torch.float32 and torch.isfinite(t).all() for t in tensors.values())
    write_tokenizer(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (DEMO_DIR / name).read_text() == (tmp_path / name).read_text(), (
            f"{name} differs from make_tiny's: rewrite it with make_tiny.write_tokenizer(model/demo)"
        )


def test_demo_model_writes_words_where_the_random_model_does_not(tiny_dir: Path) -> None:
    text = _greedy_text(DEMO_DIR)
    allowed, words = _english(text)
    assert allowed >= 0.9 and len(words) >= 3, text
    # the same measure on make_tiny's random model, which the demo model replaced as the default
    random_allowed, random_words = _english(_greedy_text(tiny_dir))
    assert random_allowed < 0.9 or len(random_words) < 3


def test_train_demo_lowers_the_loss_and_writes_what_it_trained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    corpus = tmp_path / "slice.txt"
    corpus.write_bytes(DEMO_CORPUS.read_bytes()[:20_000])
    settings = TrainSettings(steps=12, mtp_steps=8, seq_tokens=64, batch=8, warmup_steps=1, eval_batches=2)
    result = train_demo(tmp_path / "out", corpus, settings)

    assert len(result.losses_bits) == 12
    assert result.losses_bits[-1] < result.losses_bits[0] - 0.5
    assert result.eval_bits < result.initial_eval_bits - 0.5
    # then the MTP layer, on the next-next byte, from the trained model's hidden states
    assert len(result.mtp_losses_bits) == 8 and result.mtp_losses_bits[-1] < result.mtp_losses_bits[0] - 0.5
    assert json.loads((tmp_path / "out" / "config.json").read_text()) == tiny_config_dict(
        num_nextn_predict_layers=1
    )
    check_model_dir(tmp_path / "out", mtp=True)
    # the files hold the trained weights: loaded back, the held-out loss is the one measured in training
    reloaded = transformers.DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out")
    _, held_out = corpus_split(corpus)
    assert held_out_bits(reloaded, held_out, settings) == pytest.approx(result.eval_bits, abs=1e-4)


def test_the_trained_mtp_layer_is_what_the_engine_runs(tmp_path: Path) -> None:
    """The MTP layer ``train-demo`` writes, run by the engine's own ``MTPLayer`` over the paged
    pool, has the held-out next-next-byte loss measured in training: the names and the form
    (embedding at position 0 zeroed, the norms, the projection, the head) agree."""
    pytest.importorskip("transformers")
    from tandem.model.attention_metadata import AttentionMetadata
    from tandem.model.deepseek import DeepseekV3
    from tandem.model.kv_pool import KVPool
    from tandem.model.train_demo import _batch, _verse_starts

    corpus = tmp_path / "slice.txt"
    corpus.write_bytes(DEMO_CORPUS.read_bytes()[:20_000])
    settings = TrainSettings(steps=4, mtp_steps=6, seq_tokens=32, batch=4, warmup_steps=1, eval_batches=2)
    result = train_demo(tmp_path / "out", corpus, settings)
    cfg = check_model_dir(tmp_path / "out", mtp=True)
    model = DeepseekV3(cfg, torch.float32, mtp=True)
    model.load_weights(load_checkpoint(tmp_path / "out", cfg, torch.float32, mtp=True))
    _, held_out = corpus_split(corpus)
    starts = _verse_starts(held_out, settings.seq_tokens)
    gen = torch.Generator().manual_seed(1234)
    losses = []
    for _ in range(settings.eval_batches):
        for ids in _batch(held_out, starts, settings, gen):
            n = ids.numel()
            pool = KVPool(cfg, 8, 16, torch.float32, num_layers=model.num_kv_layers)
            pages = list(range(-(-n // 16)))
            hidden = model.forward(ids, torch.arange(n), AttentionMetadata.build(16, [n], [n], [pages]), pool)
            meta = AttentionMetadata.build(16, [n - 1], [n - 1], [pages])
            g = model.mtp_forward(ids[1:], torch.arange(n - 1), hidden[:-1], meta, pool)
            losses.append(torch.nn.functional.cross_entropy(model.mtp_logits(g)[:-1], ids[2:]))
    # training averages each batch's rows, then the batches: the same rows, the same weights
    bits = float(torch.stack(losses).mean()) / math.log(2)
    assert bits == pytest.approx(result.mtp_eval_bits, abs=1e-3)
