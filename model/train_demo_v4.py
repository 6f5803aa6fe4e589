"""The DeepSeek-V4 demo model: the tiny V4 of ``model/v4/tiny.py`` (CSA, HCA and sliding-window
layers, hash and scored MoE, ``hc_mult`` 2, sliding window 8, compression 4:1 and 16:1) trained
as a character-level model of the demo corpus exactly as the V3 demo is (``model/train_demo.py``:
the same batches of BOS and 256 bytes from a verse start, AdamW and schedule, gradient clip, and
loss-free balancing of the scored routers' correction bias; hash layers route by their frozen
table), with transformers' ``DeepseekV4ForCausalLM`` on the CPU, then written by its
``save_pretrained`` (DeepSeek's tensor names, which Tandem loads) beside the byte tokenizer.

Its indexer keeps every compressed entry (``index_topk`` above the entries of any demo context),
so the indexer's weights get no gradient and stay as initialised: DeepSeek trains V4's indexer
with a loss of its own, which this demo does not. Then its MTP layer
(``model/train_demo_v4_mtp.py``), ``mtp_steps`` steps on the frozen model, written as
``mtp.0.*``; ``--mtp-only`` trains only that layer onto an existing V4 demo.

``tandem model train-demo --arch deepseek_v4 DIR``; the committed ``model/demo_v4`` is
``--steps 700`` (seed 0), its held-out loss beside the V3 demo's in ``model/demo_v4/README.md``.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tandem.model.make_tiny import BOS_ID, EOS_ID, write_tokenizer
from tandem.model.train_demo import (
    DEMO_CORPUS,
    TrainResult,
    TrainSettings,
    _transformers,
    corpus_split,
    held_out_bits,
    train_model,
)
from tandem.model.train_demo_v4_mtp import DemoMTPV4, train_mtp_v4
from tandem.model.v4.checkpoint import check_v4_model_dir
from tandem.model.v4.tiny import tiny_v4_config_dict

DEMO_V4_DIR = Path(__file__).parent / "demo_v4"


def tiny_hf_v4_model(seed: int) -> Any:
    """A freshly initialised ``DeepseekV4ForCausalLM`` with the tiny V4 config (Hugging Face's
    initialisation from ``seed``)."""
    transformers = _transformers()
    raw = tiny_v4_config_dict(BOS_ID, EOS_ID)
    config = transformers.DeepseekV4Config(
        **{k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    )
    torch.manual_seed(seed)
    return transformers.DeepseekV4ForCausalLM(config)


def train_demo_v4(
    out_dir: Path | str,
    corpus: Path | str = DEMO_CORPUS,
    settings: TrainSettings | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train the tiny V4 on ``corpus`` and write its checkpoint to ``out_dir`` (written beside it,
    checked as Tandem checks any V4 directory, then renamed into place: never half-written; an
    existing ``out_dir`` is replaced)."""
    settings = settings or TrainSettings()
    model = tiny_hf_v4_model(settings.seed)
    result, train_data, held_out = train_model(model, corpus, settings, Path(out_dir), log)
    mtp = train_mtp_v4(model, train_data, held_out, settings, result, log) if settings.mtp_steps else None
    _write(model, result.out_dir, mtp)
    return result


def train_demo_v4_mtp(
    model_dir: Path | str,
    corpus: Path | str = DEMO_CORPUS,
    settings: TrainSettings | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train only the MTP layer of the V4 demo in ``model_dir`` (its model's weights are kept bit
    for bit) and write the checkpoint back with it."""
    settings = settings or TrainSettings()
    model = _transformers().DeepseekV4ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train_data, held_out = corpus_split(corpus)
    result = TrainResult(Path(model_dir), eval_bits=held_out_bits(model, held_out, settings))
    result.initial_eval_bits = result.eval_bits
    _write(model, result.out_dir, train_mtp_v4(model, train_data, held_out, settings, result, log))
    return result


def _write(model: Any, out: Path, mtp: DemoMTPV4 | None) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.config.num_nextn_predict_layers = int(mtp is not None)
        model.save_pretrained(staging)
        (staging / "generation_config.json").unlink(missing_ok=True)  # transformers' own, not read
        if mtp is not None:
            weights = staging / "model.safetensors"
            save_file(load_file(weights) | mtp.tensors(), str(weights), metadata={"format": "pt"})
        write_tokenizer(staging)
        check_v4_model_dir(staging, mtp=mtp is not None)
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)  # safetensors writes its file private; a model directory is shared
        if out.exists():
            shutil.rmtree(out)
        os.rename(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
