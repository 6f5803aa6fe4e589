"""The DeepSeek-V4 demo model: the tiny V4 of ``model/v4/tiny.py`` (CSA, HCA and sliding-window
layers, hash and scored MoE, ``hc_mult`` 2, sliding window 8, compression 4:1 and 16:1) trained
as a character-level model of the demo corpus exactly as the V3 demo is (``model/train_demo.py``:
the same batches of BOS and 256 bytes from a verse start, AdamW and schedule, gradient clip, and
loss-free balancing of the scored routers' correction bias; hash layers route by their frozen
table), with transformers' ``DeepseekV4ForCausalLM`` on the CPU, then written by its
``save_pretrained`` (DeepSeek's tensor names, which Tandem loads) beside the byte tokenizer.

Its indexer keeps every compressed entry (``index_topk`` above the entries of any demo context),
so the indexer's weights get no gradient and stay as initialised: DeepSeek trains V4's indexer
with a loss of its own, which this demo does not. It has no MTP layer (V4's is not built).

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

from tandem.model.make_tiny import BOS_ID, EOS_ID, write_tokenizer
from tandem.model.train_demo import DEMO_CORPUS, TrainResult, TrainSettings, _transformers, train_model
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
    result, _, _ = train_model(model, corpus, settings, Path(out_dir), log)
    _write(model, result.out_dir)
    return result


def _write(model: Any, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(staging)
        (staging / "generation_config.json").unlink(missing_ok=True)  # transformers' own, not read
        write_tokenizer(staging)
        check_v4_model_dir(staging)
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)  # safetensors writes its file private; a model directory is shared
        if out.exists():
            shutil.rmtree(out)
        os.rename(staging, out)
    finally:
        if staging.exists():
            shutil.rmtree(staging)
