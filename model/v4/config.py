"""DeepSeek-V4 model configuration, read from a ``config.json`` as transformers writes it for
``DeepseekV4ForCausalLM`` or as DeepSeek ships it.

Both spellings normalise to one :class:`V4Config`: the per-layer schedules ``layer_types`` and
``mlp_layer_types`` (or the older ``compress_ratios`` per layer, 0/4/128, and ``num_hash_layers``),
``compress_rates`` (or ``compress_rate_csa`` / ``compress_rate_hca``), ``partial_rotary_factor``
(or ``qk_rope_head_dim``), and the nested ``rope_parameters`` ``{"main", "compress"}`` (or one
flat set, which is the compressed layers' YaRN). Sliding-window layers rotate with the ``main``
rope (``rope_theta``, never scaled); layers with a compressor, their compressor and their
indexer with the ``compress`` rope (``compress_rope_theta``, YaRN with an attention factor of 1
unless the file sets one).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.model.config import ModelConfigError, RopeConfig, read_config_json

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, MOE = "hash_moe", "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)
SCORING_FUNCS = ("sqrtsoftplus", "softmax", "sigmoid")
_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


@dataclass(frozen=True)
class V4Config:
    vocab_size: int
    hidden_size: int
    moe_intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # of the one KV head every query head shares (K = V)
    q_lora_rank: int
    qk_rope_head_dim: int  # the trailing dims of each head that rotate
    num_experts_per_tok: int
    n_routed_experts: int
    scoring_func: str
    routed_scaling_factor: float
    max_position_embeddings: int
    rope_main: RopeConfig
    rope_compress: RopeConfig
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rate_csa: int
    compress_rate_hca: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    swiglu_limit: float
    sliding_window: int
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    rms_norm_eps: float = 1e-6
    num_nextn_predict_layers: int = 0
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    tie_word_embeddings: bool = False
    quant_block_size: tuple[int, int] | None = None  # FP8 block-scaled attention and dense weights
    expert_dtype: str | None = None  # the routed experts' format in the checkpoint: "fp4", "fp8"

    def layer_type(self, layer: int) -> str:
        """``layer``'s attention kind; past the main layers (the MTP layer) a sliding window."""
        return self.layer_types[layer] if layer < self.num_hidden_layers else SLIDING

    def compress_rate(self, layer: int) -> int:
        """Source tokens per compressed entry of ``layer``; 0 for a sliding-window layer."""
        kind = self.layer_type(layer)
        return self.compress_rate_csa if kind == CSA else self.compress_rate_hca if kind == HCA else 0

    def is_hash_layer(self, layer: int) -> bool:
        """Whether ``layer`` routes by token id (never the MTP layer: it scores)."""
        return layer < self.num_hidden_layers and self.mlp_layer_types[layer] == HASH_MOE

    def rope(self, layer: int) -> RopeConfig:
        return self.rope_main if self.layer_type(layer) == SLIDING else self.rope_compress

    @property
    def compress_rates(self) -> tuple[int, ...]:
        """The distinct compression rates of the layers (a page boundary must be a compression
        boundary of each)."""
        return tuple(sorted({self.compress_rate(i) for i in range(self.num_hidden_layers)} - {0}))

    @staticmethod
    def from_dict(raw: dict[str, Any], path: Path | str = "config.json") -> V4Config:
        def need(key: str) -> Any:
            if key not in raw or raw[key] is None:
                raise ModelConfigError(path, f"missing required field {key!r}")
            return raw[key]

        n = int(need("num_hidden_layers"))
        layer_types = _layer_types(raw, n, path)
        mlp_types = raw.get("mlp_layer_types")
        if mlp_types is None:
            n_hash = int(raw.get("num_hash_layers", 3))
            mlp_types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
        rates = dict(raw.get("compress_rates") or {CSA: 4, HCA: 128})
        if raw.get("compress_rate_csa") is not None:
            rates[CSA] = raw["compress_rate_csa"]
        if raw.get("compress_rate_hca") is not None:
            rates[HCA] = raw["compress_rate_hca"]
        head_dim = int(need("head_dim"))
        if raw.get("partial_rotary_factor") is not None:
            rope_dim = int(head_dim * float(raw["partial_rotary_factor"]))
        else:
            rope_dim = int(raw.get("qk_rope_head_dim") or 64)
        heads = int(need("num_attention_heads"))
        kv_heads = raw.get("num_key_value_heads", 1)
        if kv_heads != 1:
            raise ModelConfigError(path, f"num_key_value_heads {kv_heads}: DeepSeek-V4 shares one KV head")
        shared = raw.get("n_shared_experts", 1)
        if shared != 1:
            raise ModelConfigError(path, f"n_shared_experts {shared}: DeepSeek-V4 has one shared expert")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise ModelConfigError(path, f"hidden_act {act!r} is not supported (expected silu)")
        eos = raw.get("eos_token_id")
        main, compress = _ropes(raw, path)
        cfg = V4Config(
            vocab_size=int(need("vocab_size")),
            hidden_size=int(need("hidden_size")),
            moe_intermediate_size=int(need("moe_intermediate_size")),
            num_hidden_layers=n,
            num_attention_heads=heads,
            head_dim=head_dim,
            q_lora_rank=int(need("q_lora_rank")),
            qk_rope_head_dim=rope_dim,
            num_experts_per_tok=int(need("num_experts_per_tok")),
            n_routed_experts=int(need("n_routed_experts")),
            scoring_func=str(raw.get("scoring_func", "sqrtsoftplus")),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
            max_position_embeddings=int(need("max_position_embeddings")),
            rope_main=main,
            rope_compress=compress,
            layer_types=tuple(layer_types),
            mlp_layer_types=tuple(mlp_types),
            compress_rate_csa=int(rates.get(CSA, 4)),
            compress_rate_hca=int(rates.get(HCA, 128)),
            hc_mult=int(raw.get("hc_mult", 4)),
            hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
            hc_eps=float(raw.get("hc_eps", 1e-6)),
            swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
            sliding_window=int(need("sliding_window")),
            o_groups=int(need("o_groups")),
            o_lora_rank=int(need("o_lora_rank")),
            index_n_heads=int(raw.get("index_n_heads", 64)),
            index_head_dim=int(raw.get("index_head_dim", 128)),
            index_topk=int(raw.get("index_topk", 512)),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers") or 0),
            bos_token_id=raw.get("bos_token_id"),
            eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            quant_block_size=_quant_block(raw, path),
            expert_dtype=_expert_dtype(raw, path),
        )
        cfg.validate(path)
        return cfg

    def validate(self, path: Path | str = "config.json") -> None:
        def check(ok: bool, message: str) -> None:
            if not ok:
                raise ModelConfigError(path, message)

        n = self.num_hidden_layers
        check(len(self.layer_types) == n, f"layer_types has {len(self.layer_types)} entries for {n} layers")
        check(
            len(self.mlp_layer_types) == n,
            f"mlp_layer_types has {len(self.mlp_layer_types)} entries for {n} layers",
        )
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        check(not bad, f"layer_types: {bad} not among {list(LAYER_TYPES)}")
        bad = [t for t in self.mlp_layer_types if t not in MLP_LAYER_TYPES]
        check(not bad, f"mlp_layer_types: {bad} not among {list(MLP_LAYER_TYPES)}")
        check(
            self.scoring_func in SCORING_FUNCS,
            f"scoring_func {self.scoring_func!r} not among {list(SCORING_FUNCS)}",
        )
        check(self.compress_rate_csa > 0 and self.compress_rate_hca > 0, "compress_rates must be positive")
        check(
            0 < self.qk_rope_head_dim < self.head_dim and self.qk_rope_head_dim % 2 == 0,
            f"qk_rope_head_dim {self.qk_rope_head_dim} must be even and below head_dim {self.head_dim}",
        )
        check(
            self.index_head_dim > self.qk_rope_head_dim,
            f"index_head_dim {self.index_head_dim} must exceed qk_rope_head_dim {self.qk_rope_head_dim}",
        )
        check(
            (self.num_attention_heads * self.head_dim) % self.o_groups == 0,
            f"o_groups {self.o_groups} must divide num_attention_heads x head_dim",
        )
        check(
            1 <= self.num_experts_per_tok <= self.n_routed_experts,
            f"num_experts_per_tok {self.num_experts_per_tok} must be in [1, n_routed_experts]",
        )
        check(self.sliding_window >= 1, f"sliding_window {self.sliding_window} must be at least 1")
        check(
            self.hc_mult >= 1 and self.hc_sinkhorn_iters >= 1,
            "hc_mult and hc_sinkhorn_iters must be at least 1",
        )
        check(self.index_topk >= 1, f"index_topk {self.index_topk} must be at least 1")

    @staticmethod
    def from_dir(model_dir: Path | str) -> V4Config:
        return V4Config.from_dict(read_config_json(model_dir), Path(model_dir) / "config.json")


def _layer_types(raw: dict[str, Any], n: int, path: Path | str) -> list[str]:
    if raw.get("layer_types") is not None:
        return list(raw["layer_types"])
    ratios = raw.get("compress_ratios")
    if ratios is not None:
        unknown = [r for r in ratios if r not in _RATIO_TO_TYPE]
        if unknown:
            raise ModelConfigError(path, f"compress_ratios: {unknown} not among {sorted(_RATIO_TO_TYPE)}")
        return [_RATIO_TO_TYPE[r] for r in ratios][:n]
    interleave = [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    return [HCA] * min(n, 2) + interleave


def _ropes(raw: dict[str, Any], path: Path | str) -> tuple[RopeConfig, RopeConfig]:
    """The ``main`` and ``compress`` ropes."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelConfigError(path, f"rope_parameters must be an object, got {params!r}")
    theta = float(raw.get("rope_theta", 10000.0))
    compress_theta = float(raw.get("compress_rope_theta", 160000.0))
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main_raw, compress_raw = params["main"], params["compress"]
    else:
        flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
        main_raw = {"rope_type": "default", "rope_theta": theta}
        compress_raw = {**flat, "rope_theta": compress_theta}
    compress_raw = dict(compress_raw)
    compress_raw.setdefault("rope_type", compress_raw.get("type", "default"))
    if compress_raw["rope_type"] == "yarn":
        compress_raw.setdefault("attention_factor", 1.0)
    max_pos = {"max_position_embeddings": raw.get("max_position_embeddings", 4096)}
    main = RopeConfig.from_hf({**max_pos, "rope_parameters": main_raw}, path)
    compress = RopeConfig.from_hf({**max_pos, "rope_parameters": compress_raw}, path)
    return main, compress


def _quant_block(raw: dict[str, Any], path: Path | str) -> tuple[int, int] | None:
    quant = raw.get("quantization_config") or {}
    if not quant:
        return None
    if not isinstance(quant, dict) or quant.get("quant_method") != "fp8":
        raise ModelConfigError(path, f"quantization_config {quant!r} is not supported (expected fp8)")
    block = quant.get("weight_block_size") or [128, 128]
    return int(block[0]), int(block[1])


def _expert_dtype(raw: dict[str, Any], path: Path | str) -> str | None:
    quant = raw.get("quantization_config")
    value = raw.get("expert_dtype") or (quant.get("expert_dtype") if isinstance(quant, dict) else None)
    if value not in (None, "fp4", "fp8"):
        raise ModelConfigError(path, f"expert_dtype {value!r} is not supported (expected fp4 or fp8)")
    return value
