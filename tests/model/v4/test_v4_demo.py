"""The DeepSeek-V4 demo model: the committed checkpoint (``model/demo_v4``, loaded as any V4
directory is, writing words) and its training (``model/train_demo_v4.py``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tandem.engine.colocated import ColocatedEngine
from tandem.model.loader import load_model
from tandem.model.train_demo import (
    DEMO_CORPUS,
    TrainSettings,
    _batch,
    _verse_starts,
    corpus_split,
    held_out_bits,
)
from tandem.model.train_demo_v4 import DEMO_V4_DIR, train_demo_v4
from tandem.model.v4.attention import LayerState
from tandem.model.v4.checkpoint import check_v4_model_dir
from tandem.model.v4.tiny import tiny_v4_config_dict
from tandem.wire.request_params import SamplingParams
from tests.model.test_demo_model import PROMPT, _english, _greedy_text


def test_the_committed_v4_demo_is_the_tiny_v4_and_writes_words() -> None:
    cfg = check_v4_model_dir(DEMO_V4_DIR, mtp=True)  # config, tokenizer and every tensor's header
    tiny = tiny_v4_config_dict(256, 257)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (
        tiny["num_hidden_layers"],
        tiny["hidden_size"],
        tiny["vocab_size"],
    )
    text = _greedy_text(DEMO_V4_DIR)
    allowed, words = _english(text)
    assert allowed >= 0.9 and len(words) >= 3, text


def test_the_committed_v4_demos_mtp_layer_mostly_guesses_the_models_own_token() -> None:
    from tandem.bench.v4_mtp_agreement import agreement

    agree, truth, positions = agreement(str(DEMO_V4_DIR), batches=1)
    assert positions == 8 * 255 and agree > 0.7 and truth > 0.6  # 8 rows of BOS + 256 bytes


def test_train_demo_v4_lowers_the_loss_and_writes_what_it_trained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    corpus = tmp_path / "slice.txt"
    corpus.write_bytes(DEMO_CORPUS.read_bytes()[:20_000])
    settings = TrainSettings(steps=8, mtp_steps=0, seq_tokens=64, batch=8, warmup_steps=1, eval_batches=2)
    result = train_demo_v4(tmp_path / "out", corpus, settings)
    assert len(result.losses_bits) == 8
    assert result.losses_bits[-1] < result.losses_bits[0] - 0.5
    assert result.eval_bits < result.initial_eval_bits - 0.5
    check_v4_model_dir(tmp_path / "out")
    assert load_model(tmp_path / "out", torch.float32, "cpu").cfg.num_nextn_predict_layers == 0
    assert not list(tmp_path.glob(".out.*"))  # nothing half-written left beside it
    # the files hold the trained weights, and Tandem runs them as transformers does
    reloaded = transformers.DeepseekV4ForCausalLM.from_pretrained(tmp_path / "out").eval()
    _, held_out = corpus_split(corpus)
    assert held_out_bits(reloaded, held_out, settings) == pytest.approx(result.eval_bits, abs=1e-4)
    engine = ColocatedEngine.from_model_dir(tmp_path / "out")
    assert engine.tokenizer is not None
    ids = engine.tokenizer.encode(PROMPT)
    [out] = engine.generate([ids], SamplingParams(max_tokens=16, ignore_eos=True))
    with torch.no_grad():
        want = reloaded.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None)
    assert out.token_ids == want[0, len(ids) :].tolist()


def test_the_trained_v4_mtp_layer_is_what_tandem_runs(tmp_path: Path) -> None:
    """Train the model a few steps and its MTP layer a few more; Tandem's MTP layer, loaded from
    the written ``mtp.0.*``, scores the held-out batches as the training module did."""
    pytest.importorskip("transformers")
    corpus = tmp_path / "slice.txt"
    corpus.write_bytes(DEMO_CORPUS.read_bytes()[:20_000])
    settings = TrainSettings(steps=4, mtp_steps=8, seq_tokens=32, batch=4, warmup_steps=1, eval_batches=2)
    result = train_demo_v4(tmp_path / "out", corpus, settings)
    assert len(result.mtp_losses_bits) == 8 and result.mtp_losses_bits[-1] < result.mtp_losses_bits[0] - 0.3
    model = load_model(tmp_path / "out", torch.float32, "cpu", mtp=True)
    _, held_out = corpus_split(corpus)
    starts = _verse_starts(held_out, settings.seq_tokens)
    gen = torch.Generator().manual_seed(1234)  # the held-out batches mtp_held_out_bits draws
    losses = []
    for _ in range(settings.eval_batches):
        batch = _batch(held_out, starts, settings, gen)
        rows, n = batch.shape
        positions = torch.arange(n).repeat(rows)
        streams = model(
            batch.flatten(), positions, [n] * rows, [model.new_state() for _ in range(rows)], True
        )
        keep = positions < n - 1  # row p: the streams at p and the byte at p + 1
        nxt = batch[:, 1:].flatten()
        hidden, _ = model.draft(
            streams[keep], nxt, positions[keep], [n - 1] * rows, [LayerState() for _ in range(rows)]
        )
        logits = model.compute_logits(hidden).view(rows, n - 1, -1)[:, :-1]
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 2:].flatten()))
    bits = float(torch.stack(losses).mean()) / math.log(2)
    assert bits == pytest.approx(result.mtp_eval_bits, abs=1e-3)
