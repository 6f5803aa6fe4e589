"""Tiny random DeepSeek-V3 checkpoints written by Hugging Face ``transformers`` (the golden reference)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY: dict[str, Any] = dict(
    vocab_size=300,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=32,
    q_lora_rank=24,
    qk_rope_head_dim=8,
    v_head_dim=16,
    qk_nope_head_dim=16,
    n_group=2,
    topk_group=1,
    num_experts_per_tok=3,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=512,
    rms_norm_eps=1e-6,
    bos_token_id=0,
    eos_token_id=1,
    tie_word_embeddings=False,
    num_mtp_layers=0,
)

VARIANTS: dict[str, dict[str, Any]] = {
    "qlora": {},
    "no-qlora": {"q_lora_rank": None, "first_k_dense_replace": 2},
    "yarn": {
        "rope_parameters": {
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "max_position_embeddings": 512,
    },
    "groups": {"n_routed_experts": 16, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4},
    "no-interleave": {"rope_interleave": False, "norm_topk_prob": False},
}


def make_hf_checkpoint(
    path: Path, variant: str = "qlora", seed: int = 0, dtype: torch.dtype = torch.float32
) -> Any:
    """Save a random ``DeepseekV3ForCausalLM`` to ``path`` and return the model (eval mode)."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    cfg = DeepseekV3Config(**{**TINY, **VARIANTS[variant]})
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(cfg).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                std = 0.5 / p.shape[-1] ** 0.5
                p.copy_(std * torch.randn(p.shape, generator=gen))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(0.05 * torch.randn(b.shape, generator=gen))
    model.save_pretrained(path)
    return model.to(dtype)


def dequantised_hf_model(fp8_dir: Path, out_dir: Path, dtype: torch.dtype = torch.float64) -> Any:
    """``transformers`` on an FP8 checkpoint (``make_tiny_checkpoint(fp8_block=...)``) dequantised
    to float32 into ``out_dir``, run in ``dtype`` (the reference DeepSeek gives)."""
    import json

    from transformers import DeepseekV3ForCausalLM

    from tandem.model.checkpoint import load_checkpoint
    from tandem.model.config import ModelConfig
    from tandem.model.make_tiny import write_checkpoint

    raw = json.loads((fp8_dir / "config.json").read_text())
    raw.pop("quantization_config")
    cfg = ModelConfig.from_dir(fp8_dir)
    write_checkpoint(out_dir, raw, load_checkpoint(fp8_dir, cfg, torch.float32))
    hf = DeepseekV3ForCausalLM.from_pretrained(out_dir).eval().to(dtype)
    hf.config._attn_implementation = "sdpa"
    hf.config._experts_implementation = "eager"
    return hf


def greedy_hf_tokens(hf: Any, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Each prompt's greedy continuation by a ``transformers`` model, one prompt at a time."""
    return [
        hf.generate(
            torch.tensor([p]), max_new_tokens=max_new_tokens, do_sample=False, top_k=None, top_p=None
        )[0, len(p) :].tolist()
        for p in prompts
    ]
