"""The V4 demo's multi-token-prediction layer, trained on the trained (frozen) tiny V4 in the form
``model/v4/mtp.py`` runs it: row ``i`` takes the model's residual streams at ``i`` (before its
hyper-head) and the byte at ``i + 1``, and predicts the byte at ``i + 2``; DeepSeek-V4's MTP loss
(that byte's cross-entropy), ``TrainSettings.mtp_steps`` steps with the model frozen, the
embedding and head shared with it (DeepSeek-V4's MTP layer has none of its own).

The block is transformers' ``DeepseekV4DecoderLayer`` as one more layer of a copy of the model
(sliding window, scored MoE), so that transformers' ``save_pretrained`` writes it under
DeepSeek's names (``layers.N.*``, renamed ``mtp.0.*``); the glue (``enorm``, ``hnorm``,
``e_proj``, ``h_proj``, its own hyper-head, ``norm``) is DeepSeek's ``MTPBlock``."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from tandem.model.make_tiny import BOS_ID, EOS_ID
from tandem.model.train_demo import TrainResult, TrainSettings, _transformers, fit_mtp
from tandem.model.v4.tiny import tiny_v4_config_dict


class DemoMTPV4(torch.nn.Module):
    def __init__(self, model: Any, seed: int) -> None:
        super().__init__()
        transformers = _transformers()
        modeling = transformers.models.deepseek_v4.modeling_deepseek_v4
        cfg = model.config
        n = cfg.num_hidden_layers
        raw = tiny_v4_config_dict(
            BOS_ID,
            EOS_ID,
            num_hidden_layers=n + 1,
            layer_types=[*cfg.layer_types, "sliding_attention"],
            mlp_layer_types=[*cfg.mlp_layer_types, "moe"],
        )
        self.config = transformers.DeepseekV4Config(
            **{k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
        )
        torch.manual_seed(seed + 1)
        self.extended = transformers.DeepseekV4ForCausalLM(self.config)  # the model, plus the block
        self.extended.load_state_dict(model.state_dict(), strict=False)
        self.extended.requires_grad_(False)
        self.block = self.extended.model.layers[n]
        self.block.requires_grad_(True)
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.enorm = modeling.DeepseekV4RMSNorm(h, eps=eps)
        self.hnorm = modeling.DeepseekV4RMSNorm(h, eps=eps)
        self.norm = modeling.DeepseekV4RMSNorm(h, eps=eps)
        self.e_proj = torch.nn.Linear(h, h, bias=False)
        self.h_proj = torch.nn.Linear(h, h, bias=False)
        for proj in (self.e_proj, self.h_proj):
            torch.nn.init.normal_(proj.weight, std=cfg.initializer_range)
        self.hc_head = modeling.DeepseekV4HyperHead(cfg)
        self.hc_head.load_state_dict(model.model.hc_head.state_dict())  # starts as the model's

    def forward(self, ids: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
        """The mean loss in nats of predicting ``ids[:, i + 2]`` from ``ids[:, i + 1]`` and
        ``streams[:, i]`` (``ids [B, L]``, ``streams [B, L, hc_mult, D]`` the model's before its
        hyper-head)."""
        from transformers.masking_utils import create_sliding_window_causal_mask

        core = self.extended.model
        nxt = ids[:, 1:]
        x = self.e_proj(self.enorm(core.embed_tokens(nxt))).unsqueeze(2) + self.h_proj(
            self.hnorm(streams[:, :-1])
        )
        positions = torch.arange(nxt.shape[1], device=ids.device).unsqueeze(0)
        rope = {
            kind: core.rotary_emb(x[:, :, 0], positions, layer_type=kind) for kind in ("main", "compress")
        }
        mask = create_sliding_window_causal_mask(
            config=self.config,
            inputs_embeds=x[:, :, 0],
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )
        x = self.block(
            x, position_embeddings=rope, position_ids=positions, attention_mask=mask, input_ids=nxt
        )
        logits = self.extended.lm_head(self.norm(self.hc_head(x)))
        return F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 2:].flatten())

    def tensors(self) -> dict[str, torch.Tensor]:
        """Its weights under DeepSeek's names (``mtp.0.*``)."""
        n = self.config.num_hidden_layers - 1
        with tempfile.TemporaryDirectory() as tmp:
            self.extended.save_pretrained(tmp)
            saved = load_file(Path(tmp) / "model.safetensors")
        out = {}
        for name, tensor in saved.items():
            bare = name.removeprefix("model.")
            if bare.startswith(f"layers.{n}."):
                out["mtp.0." + bare.removeprefix(f"layers.{n}.")] = tensor
        for name in ("enorm", "hnorm", "norm", "e_proj", "h_proj"):
            out[f"mtp.0.{name}.weight"] = getattr(self, name).weight.detach().float().clone()
        for name in ("fn", "base", "scale"):
            out[f"mtp.0.hc_head_{name}"] = getattr(self.hc_head, f"hc_{name}").detach().float().clone()
        return out


def model_streams(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The model's residual streams before its hyper-head, ``[B, L, hc_mult, D]``."""
    captured: list[torch.Tensor] = []
    hook = model.model.hc_head.register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        with torch.no_grad():
            model.model(input_ids=ids)
    finally:
        hook.remove()
    return captured[0]


def train_mtp_v4(
    model: Any,
    train_data: torch.Tensor,
    held_out: torch.Tensor,
    settings: TrainSettings,
    result: TrainResult,
    log: Callable[[str], None] | None = None,
) -> DemoMTPV4:
    mtp = DemoMTPV4(model, settings.seed)
    model.eval()
    fit_mtp(mtp, lambda ids: mtp(ids, model_streams(model, ids)), train_data, held_out, settings, result, log)
    return mtp
