"""DeepSeek-V3 model configuration, read from a Hugging Face ``config.json``.

Hub checkpoints write RoPE scaling as ``rope_scaling`` (with ``type`` and a top-level
``rope_theta``); transformers 5 writes ``rope_parameters`` (with ``rope_type`` and ``rope_theta``
inside). Both normalise to one :class:`RopeConfig`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.model.errors import ModelFileError

SUPPORTED_ARCHITECTURES = ("DeepseekV3ForCausalLM",)
SUPPORTED_MODEL_TYPES = ("deepseek_v3",)


class ModelConfigError(ModelFileError):
    """``config.json`` is missing, unreadable or describes something Tandem cannot run."""


@dataclass(frozen=True)
class RopeConfig:
    rope_type: str = "default"  # "default" or "yarn"
    theta: float = 10000.0
    factor: float = 1.0
    original_max_position_embeddings: int = 4096
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    @staticmethod
    def from_hf(raw: dict[str, Any], path: Path | str) -> RopeConfig:
        params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
        if not isinstance(params, dict):
            raise ModelConfigError(path, f"rope_parameters/rope_scaling must be an object, got {params!r}")
        rope_type = params.get("rope_type") or params.get("type") or "default"
        if rope_type not in ("default", "yarn"):
            raise ModelConfigError(
                path, f"rope type {rope_type!r} is not supported (expected default or yarn)"
            )
        theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
        max_pos = int(raw.get("max_position_embeddings", 4096))
        original = params.get("original_max_position_embeddings") or max_pos
        factor = params.get("factor")
        if factor is None:
            factor = max_pos / original if rope_type == "yarn" else 1.0
        return RopeConfig(
            rope_type=rope_type,
            theta=float(theta),
            factor=float(factor),
            original_max_position_embeddings=int(original),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            attention_factor=params.get("attention_factor"),
            truncate=bool(params.get("truncate", True)),
        )


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    if scale <= 1:
        return 1.0
    return 0.1 * mscale * math.log(scale) + 1.0


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    n_shared_experts: int
    n_routed_experts: int
    routed_scaling_factor: float
    kv_lora_rank: int
    q_lora_rank: int | None
    qk_rope_head_dim: int
    v_head_dim: int
    qk_nope_head_dim: int
    n_group: int
    topk_group: int
    num_experts_per_tok: int
    first_k_dense_replace: int
    norm_topk_prob: bool
    max_position_embeddings: int
    rms_norm_eps: float
    rope: RopeConfig = field(default_factory=RopeConfig)
    rope_interleave: bool = True
    attention_bias: bool = False
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    quant_block_size: tuple[int, int] | None = None  # FP8 block-scaled checkpoints
    # multi-token-prediction layers after the last decoder layer (DeepSeek-V3 ships one)
    num_nextn_predict_layers: int = 0

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def kv_cache_dim(self) -> int:
        """Numbers per token per layer in the latent KV pool: the latent and the rope key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        scale = self.qk_head_dim**-0.5
        if self.rope.rope_type != "default" and self.rope.mscale_all_dim:
            m = yarn_mscale(self.rope.factor, self.rope.mscale_all_dim)
            scale = scale * m * m
        return scale

    def is_moe_layer(self, layer: int) -> bool:
        return layer >= self.first_k_dense_replace

    @staticmethod
    def from_dict(raw: dict[str, Any], path: Path | str = "config.json") -> ModelConfig:
        architectures = raw.get("architectures") or []
        model_type = raw.get("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES and not set(architectures) & set(SUPPORTED_ARCHITECTURES):
            found = ", ".join(architectures) or "none"
            raise ModelConfigError(
                path,
                f"architecture {found} (model_type {model_type!r}) is not supported; "
                "expected DeepseekV3ForCausalLM (model_type 'deepseek_v3')",
            )

        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ModelConfigError(path, f"missing required field {key!r}")
            return raw[key]

        eos = raw.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        quant = raw.get("quantization_config") or {}
        block = quant.get("weight_block_size") if isinstance(quant, dict) else None
        if quant and (not isinstance(quant, dict) or quant.get("quant_method") != "fp8"):
            raise ModelConfigError(path, f"quantization_config {quant!r} is not supported (expected fp8)")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(path, f"hidden_act {act!r} is not supported (expected silu)")
        heads = int(need("num_attention_heads"))
        kv_heads = raw.get("num_key_value_heads") or heads
        if kv_heads != heads:
            raise ModelConfigError(
                path, f"num_key_value_heads {kv_heads} must equal num_attention_heads {heads}"
            )
        cfg = ModelConfig(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            intermediate_size=int(need("intermediate_size")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=heads,
            n_shared_experts=int(raw.get("n_shared_experts") or 0),
            n_routed_experts=int(need("n_routed_experts")),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            kv_lora_rank=int(need("kv_lora_rank")),
            q_lora_rank=None if raw.get("q_lora_rank") is None else int(raw["q_lora_rank"]),
            qk_rope_head_dim=int(need("qk_rope_head_dim")),
            v_head_dim=int(need("v_head_dim")),
            qk_nope_head_dim=int(need("qk_nope_head_dim")),
            n_group=int(raw.get("n_group") or 1),
            topk_group=int(raw.get("topk_group") or 1),
            num_experts_per_tok=int(need("num_experts_per_tok")),
            first_k_dense_replace=int(raw.get("first_k_dense_replace") or 0),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
            max_position_embeddings=int(need("max_position_embeddings")),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope=RopeConfig.from_hf(raw, path),
            rope_interleave=bool(raw.get("rope_interleave", True)),
            attention_bias=bool(raw.get("attention_bias", False)),
            hidden_act=act,
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=eos_ids,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            quant_block_size=(int(block[0]), int(block[1])) if block else None,
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers")) or 0),
        )
        cfg.validate(path)
        return cfg

    def validate(self, path: Path | str = "config.json") -> None:
        if self.n_routed_experts % self.n_group:
            raise ModelConfigError(path, f"n_routed_experts {self.n_routed_experts} not divisible by n_group")
        if not 1 <= self.topk_group <= self.n_group:
            raise ModelConfigError(
                path, f"topk_group {self.topk_group} must be in [1, n_group={self.n_group}]"
            )
        if self.num_experts_per_tok > self.topk_group * (self.n_routed_experts // self.n_group):
            raise ModelConfigError(path, "num_experts_per_tok exceeds the experts in the selected groups")
        if self.qk_rope_head_dim % 2:
            raise ModelConfigError(path, f"qk_rope_head_dim {self.qk_rope_head_dim} must be even")

    @staticmethod
    def from_dir(model_dir: Path | str) -> ModelConfig:
        return ModelConfig.from_dict(read_config_json(model_dir), Path(model_dir) / "config.json")


def read_config_json(model_dir: Path | str) -> dict[str, Any]:
    """``config.json`` of a model directory as a dict; an error names the file."""
    path = Path(model_dir) / "config.json"
    if not Path(model_dir).is_dir():
        raise ModelConfigError(model_dir, "model directory does not exist")
    if not path.is_file():
        raise ModelConfigError(path, "config.json not found in the model directory")
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ModelConfigError(path, f"cannot read config.json: {exc}") from exc
    if not isinstance(raw, dict):
        raise ModelConfigError(path, "config.json must hold a JSON object")
    return raw


def expected_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint must hold, by its Hugging Face name, with its shape."""
    h = cfg.hidden_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h)}
    for i in range(cfg.num_hidden_layers):
        shapes |= _layer_shapes(cfg, i)
    shapes["model.norm.weight"] = (h,)
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    return shapes


def expected_mtp_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The first multi-token-prediction layer's tensors: layer ``N = num_hidden_layers``, a full
    decoder layer plus its own embedding, the norms of its two inputs, their projection and its
    output head (``model.layers.N.shared_head.*``)."""
    h, n = cfg.hidden_size, cfg.num_hidden_layers
    p = f"model.layers.{n}."
    return {
        p + "embed_tokens.weight": (cfg.vocab_size, h),
        p + "enorm.weight": (h,),
        p + "hnorm.weight": (h,),
        p + "eh_proj.weight": (h, 2 * h),
        **_layer_shapes(cfg, n),
        p + "shared_head.norm.weight": (h,),
        p + "shared_head.head.weight": (cfg.vocab_size, h),
    }


def _layer_shapes(cfg: ModelConfig, i: int) -> dict[str, tuple[int, ...]]:
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    shapes: dict[str, tuple[int, ...]] = {}
    p = f"model.layers.{i}."
    shapes[p + "input_layernorm.weight"] = (h,)
    shapes[p + "post_attention_layernorm.weight"] = (h,)
    a = p + "self_attn."
    if cfg.q_lora_rank is None:
        shapes[a + "q_proj.weight"] = (heads * cfg.qk_head_dim, h)
    else:
        shapes[a + "q_a_proj.weight"] = (cfg.q_lora_rank, h)
        shapes[a + "q_a_layernorm.weight"] = (cfg.q_lora_rank,)
        shapes[a + "q_b_proj.weight"] = (heads * cfg.qk_head_dim, cfg.q_lora_rank)
    shapes[a + "kv_a_proj_with_mqa.weight"] = (cfg.kv_cache_dim, h)
    shapes[a + "kv_a_layernorm.weight"] = (cfg.kv_lora_rank,)
    shapes[a + "kv_b_proj.weight"] = (heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank)
    shapes[a + "o_proj.weight"] = (h, heads * cfg.v_head_dim)
    if cfg.attention_bias:
        if cfg.q_lora_rank is not None:
            shapes[a + "q_a_proj.bias"] = (cfg.q_lora_rank,)
        shapes[a + "kv_a_proj_with_mqa.bias"] = (cfg.kv_cache_dim,)
        shapes[a + "o_proj.bias"] = (h,)
    m = p + "mlp."
    if cfg.is_moe_layer(i):
        inter = cfg.moe_intermediate_size
        shapes[m + "gate.weight"] = (cfg.n_routed_experts, h)
        shapes[m + "gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
        for e in range(cfg.n_routed_experts):
            shapes[m + f"experts.{e}.gate_proj.weight"] = (inter, h)
            shapes[m + f"experts.{e}.up_proj.weight"] = (inter, h)
            shapes[m + f"experts.{e}.down_proj.weight"] = (h, inter)
        if cfg.n_shared_experts:
            shared = inter * cfg.n_shared_experts
            shapes[m + "shared_experts.gate_proj.weight"] = (shared, h)
            shapes[m + "shared_experts.up_proj.weight"] = (shared, h)
            shapes[m + "shared_experts.down_proj.weight"] = (h, shared)
    else:
        shapes[m + "gate_proj.weight"] = (cfg.intermediate_size, h)
        shapes[m + "up_proj.weight"] = (cfg.intermediate_size, h)
        shapes[m + "down_proj.weight"] = (h, cfg.intermediate_size)
    return shapes
