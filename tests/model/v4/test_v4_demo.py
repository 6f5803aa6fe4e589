"""The DeepSeek-V4 demo model: the committed checkpoint (``model/demo_v4``, loaded as any V4
directory is, writing words) and its training (``model/train_demo_v4.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.engine.colocated import ColocatedEngine
from tandem.model.train_demo import DEMO_CORPUS, TrainSettings, corpus_split, held_out_bits
from tandem.model.train_demo_v4 import DEMO_V4_DIR, train_demo_v4
from tandem.model.v4.checkpoint import check_v4_model_dir
from tandem.model.v4.tiny import tiny_v4_config_dict
from tandem.wire.request_params import SamplingParams
from tests.model.test_demo_model import PROMPT, _english, _greedy_text


def test_the_committed_v4_demo_is_the_tiny_v4_and_writes_words() -> None:
    cfg = check_v4_model_dir(DEMO_V4_DIR)  # config, tokenizer and every tensor's header
    tiny = tiny_v4_config_dict(256, 257)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.vocab_size) == (
        tiny["num_hidden_layers"],
        tiny["hidden_size"],
        tiny["vocab_size"],
    )
    text = _greedy_text(DEMO_V4_DIR)
    allowed, words = _english(text)
    assert allowed >= 0.9 and len(words) >= 3, text


def test_train_demo_v4_lowers_the_loss_and_writes_what_it_trained(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    corpus = tmp_path / "slice.txt"
    corpus.write_bytes(DEMO_CORPUS.read_bytes()[:20_000])
    settings = TrainSettings(steps=8, seq_tokens=64, batch=8, warmup_steps=1, eval_batches=2)
    result = train_demo_v4(tmp_path / "out", corpus, settings)
    assert len(result.losses_bits) == 8
    assert result.losses_bits[-1] < result.losses_bits[0] - 0.5
    assert result.eval_bits < result.initial_eval_bits - 0.5
    check_v4_model_dir(tmp_path / "out")
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
