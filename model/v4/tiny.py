"""A tiny DeepSeek-V4 made from a seed: ``config.json`` as transformers writes it for
``DeepseekV4ForCausalLM`` and random tensors under DeepSeek's names, so that Tandem and
transformers load the same weights. The default has every layer type (CSA, HCA, sliding
window), hash and scored MoE layers, a YaRN compress rope and an indexer that keeps every entry
(``index_topk`` above the entries of any prompt the tests use); ``overrides`` change any field.

Weights are larger than transformers' initialisation so that greedy output varies from token
to token; the gates' positional biases and the sinks are not zero, so every term counts."""

from __future__ import annotations

from typing import Any

import torch

from tandem.model.kernels.fp8 import quantize_fp8_block
from tandem.model.v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, V4Config
from tandem.model.v4.names import expected_v4_tensor_shapes, is_fp8_weight

TINY_V4_CONFIG: dict[str, Any] = {
    "vocab_size": 258,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "partial_rotary_factor": 0.25,
    "q_lora_rank": 32,
    "num_experts_per_tok": 2,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "scoring_func": "sqrtsoftplus",
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.5,
    "max_position_embeddings": 2048,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 512,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
    },
    "layer_types": [CSA, HCA, SLIDING, CSA],
    "mlp_layer_types": [HASH_MOE, MOE, MOE, MOE],
    "compress_rates": {CSA: 4, HCA: 16},
    "hc_mult": 2,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "swiglu_limit": 10.0,
    "sliding_window": 8,
    "o_groups": 2,
    "o_lora_rank": 16,
    "index_n_heads": 2,
    "index_head_dim": 16,
    "index_topk": 1024,
    "num_nextn_predict_layers": 0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
}


def tiny_v4_config_dict(bos_id: int, eos_id: int, **overrides: Any) -> dict[str, Any]:
    raw: dict[str, Any] = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
    raw |= TINY_V4_CONFIG | {"bos_token_id": bos_id, "eos_token_id": eos_id}
    raw.update(overrides)
    return raw


def tiny_v4_weights(cfg: V4Config, seed: int) -> dict[str, torch.Tensor]:
    """Random tensors for every name of ``cfg`` (the MTP layer's too when it has one), the same
    for the same seed."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in expected_v4_tensor_shapes(cfg, mtp=cfg.num_nextn_predict_layers > 0).items():
        if name.endswith("tid2eid"):  # each token's experts: distinct ones
            rows = [
                torch.randperm(cfg.n_routed_experts, generator=generator)[: shape[1]] for _ in range(shape[0])
            ]
            tensors[name] = torch.stack(rows)
            continue
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + 0.05 * noise
        elif name.endswith(("_base", "ape", "gate.bias")):
            tensors[name] = 0.1 * noise
        elif name.endswith("_scale"):
            tensors[name] = 1.0 + 0.1 * noise
        elif name.endswith("attn_sink") or name == "embed.weight":
            tensors[name] = noise
        else:
            tensors[name] = 1.5 / shape[-1] ** 0.5 * noise
    return tensors


def quantize_like_deepseek_v4(cfg: V4Config, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """DeepSeek-V4's FP8 release format: each FP8 weight (``names.is_fp8_weight``: the attention's
    projections, the indexer's query projection, the experts) in FP8 with its block scales under
    ``<module>.scale``; everything else as it is."""
    assert cfg.quant_block_size is not None
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if is_fp8_weight(name, cfg):
            out[name], out[name.removesuffix(".weight") + ".scale"] = quantize_fp8_block(
                tensor, cfg.quant_block_size
            )
        else:
            out[name] = tensor
    return out
