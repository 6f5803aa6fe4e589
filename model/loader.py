"""A model directory's model, of whichever DeepSeek family its ``config.json`` names
(``model/family.py``): DeepSeek-V3's :class:`~tandem.model.deepseek.DeepseekV3` or V4's
:class:`~tandem.model.v4.model.DeepseekV4`, with this copy's share of the routed experts (the
others are never read) and, for V3, its MTP layer when asked. The checkpoint is checked whole
(every tensor's name, shape and dtype from the file headers) before a tensor is read."""

from __future__ import annotations

from pathlib import Path

import torch

from tandem.model.checkpoint import check_model_dir, iter_checkpoint
from tandem.model.config import ModelConfig
from tandem.model.deepseek import DeepseekV3
from tandem.model.expert_dispatch import ExpertDispatcher
from tandem.model.family import AnyConfig, read_config
from tandem.model.v4.checkpoint import check_v4_model_dir, iter_v4_checkpoint
from tandem.model.v4.config import V4Config
from tandem.model.v4.model import DeepseekV4

AnyModel = DeepseekV3 | DeepseekV4


def is_v4_dir(model_dir: Path) -> bool:
    """Whether the directory's ``config.json`` is DeepSeek-V4's (a missing one is left to V3's
    reader, whose error names the directory)."""
    return (model_dir / "config.json").is_file() and isinstance(read_config(model_dir), V4Config)


def load_model(
    model_dir: Path | str,
    dtype: torch.dtype,
    device: torch.device | str,
    experts: range | None = None,
    dispatcher: ExpertDispatcher | None = None,
    mtp: bool = False,
) -> AnyModel:
    model_dir = Path(model_dir)
    if is_v4_dir(model_dir):
        v4 = check_v4_model_dir(model_dir, mtp)
        model4 = DeepseekV4(v4, dtype, device, experts=experts, dispatcher=dispatcher, mtp=mtp)
        model4.load_weights(iter_v4_checkpoint(model_dir, v4, experts, mtp))
        return model4
    cfg = ModelConfig.from_dir(model_dir)
    model = DeepseekV3(cfg, dtype, device, experts=experts, dispatcher=dispatcher, mtp=mtp)
    model.load_weights(
        iter_checkpoint(
            model_dir, cfg, dtype, expert_filter=model.owns_expert, mtp=mtp, keep_fp8=model.keeps_fp8
        )
    )
    return model


def check_any_model_dir(model_dir: Path | str) -> AnyConfig:
    """Either family's directory checked whole from its headers (its ``config.json``, tokenizer
    and every tensor's name, shape and dtype) before anything starts; the config."""
    if is_v4_dir(Path(model_dir)):
        return check_v4_model_dir(model_dir)
    return check_model_dir(model_dir)
