"""What one rank of a DEP group holds, counted from the config alone (torch-free): its slice of
the routed experts (:func:`expert_slice`) and the bytes of its resident weights
(:func:`rank_weight_bytes`), parameter by parameter as ``DeepseekV3`` allocates them::

    every rank (replicated)                       the rank's slice of the routed experts
    embed_tokens, lm_head, norms      dtype       w_gate_up, w_down   FP8 (+ float32 scales),
    attention projections, dense MLPs,            per MoE layer       or dtype
      shared experts     FP8 (+ float32 scales), or dtype
    kv_b_proj                         dtype (an FP8 checkpoint's is dequantised at load)
    MoE gate, e_score_correction_bias float32
    the MTP layer, when held: embed_tokens, enorm, hnorm, eh_proj, shared_head in dtype,
      its decoder layer as above

An FP8 weight ``[out, in]`` is 1 byte a number plus its float32 block scales
``ceil(out / b0) x ceil(in / b1)``. ``tests/model/test_rank_weights.py`` holds the count to
``DeepseekV3(...).weight_bytes()`` built on the meta device.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.model.config import ModelConfig

# the dtypes a model runs in (``model/dtypes.py``), by their size in bytes
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8}
FP8_BYTES = 1
SCALE_BYTES = 4  # block scales are float32
ROUTER_BYTES = 4  # the MoE gate and its correction bias stay float32


def expert_slice(num_experts: int, rank: int, world_size: int) -> range:
    """Rank ``rank``'s routed experts: contiguous slices, the first ``E % n`` ranks one expert
    more than the rest (256 experts on 144 ranks: 112 ranks hold 2, 32 hold 1); with fewer
    experts than ranks the last ranks hold none and serve attention only."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a DEP group of {world_size} ranks")
    base, extra = divmod(num_experts, world_size)
    start = rank * base + min(rank, extra)
    return range(start, start + base + (1 if rank < extra else 0))


@dataclass(frozen=True)
class RankWeightBytes:
    """A rank's resident weights: what every rank of the group holds, and its expert slice."""

    replicated_bytes: int
    routed_expert_bytes: int

    @property
    def total_bytes(self) -> int:
        return self.replicated_bytes + self.routed_expert_bytes


def dtype_bytes(dtype: str) -> int:
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPE_BYTES)}") from None


def rank_weight_bytes(
    cfg: ModelConfig, dtype: str, rank: int, world_size: int, mtp: bool = False, keep_fp8: bool = True
) -> RankWeightBytes:
    """The weights rank ``rank`` of a DEP group of ``world_size`` holds in ``dtype``, with
    ``mtp`` the checkpoint's multi-token-prediction layer too; ``keep_fp8`` as ``DeepseekV3``'s."""
    if mtp and cfg.num_nextn_predict_layers < 1:
        raise ValueError("the model's config.json has no multi-token-prediction layer")
    sizes = _Sizes(dtype_bytes(dtype), cfg.quant_block_size if keep_fp8 else None)
    local_experts = len(expert_slice(cfg.n_routed_experts, rank, world_size))
    h, vocab = cfg.hidden_size, cfg.vocab_size
    replicated = 2 * vocab * h * sizes.dtype + h * sizes.dtype  # embed_tokens, lm_head, norm
    routed = 0
    layers = list(range(cfg.num_hidden_layers)) + ([cfg.num_hidden_layers] if mtp else [])
    for index in layers:
        shared, experts = _layer_bytes(cfg, index, local_experts, sizes)
        replicated += shared
        routed += experts
    if mtp:  # its own embedding and head, enorm, hnorm, shared_head's norm, eh_proj
        replicated += 2 * vocab * h * sizes.dtype + 3 * h * sizes.dtype
        replicated += sizes.linear(2 * h, h, fp8=False)
    return RankWeightBytes(replicated, routed)


@dataclass(frozen=True)
class _Sizes:
    dtype: int  # bytes of a number in the model dtype
    fp8_block: tuple[int, int] | None

    def linear(self, in_dim: int, out_dim: int, fp8: bool = True, bias: bool = False) -> int:
        """A ``Linear(in_dim, out_dim)``: FP8 with its scales where the checkpoint is, else dtype."""
        block = self.fp8_block if fp8 else None
        total = out_dim * self.dtype if bias else 0
        if block is None:
            return total + out_dim * in_dim * self.dtype
        return total + out_dim * in_dim * FP8_BYTES + self.scales(out_dim, in_dim)

    def scales(self, out_dim: int, in_dim: int) -> int:
        assert self.fp8_block is not None
        return math.ceil(out_dim / self.fp8_block[0]) * math.ceil(in_dim / self.fp8_block[1]) * SCALE_BYTES


def _layer_bytes(cfg: ModelConfig, index: int, local_experts: int, s: _Sizes) -> tuple[int, int]:
    """One decoder layer: (bytes every rank holds, bytes of this rank's routed experts)."""
    h, heads, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
    shared = 2 * h * s.dtype  # input_layernorm, post_attention_layernorm
    if cfg.q_lora_rank is None:
        shared += s.linear(h, heads * cfg.qk_head_dim)
    else:
        shared += s.linear(h, cfg.q_lora_rank, bias=bias) + cfg.q_lora_rank * s.dtype
        shared += s.linear(cfg.q_lora_rank, heads * cfg.qk_head_dim)
    shared += s.linear(h, cfg.kv_cache_dim, bias=bias) + cfg.kv_lora_rank * s.dtype
    shared += s.linear(cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), fp8=False)
    shared += s.linear(heads * cfg.v_head_dim, h, bias=bias)
    if not cfg.is_moe_layer(index):
        return shared + _mlp_bytes(h, cfg.intermediate_size, s), 0
    inter = cfg.moe_intermediate_size
    shared += (cfg.n_routed_experts * h + cfg.n_routed_experts) * ROUTER_BYTES
    if cfg.n_shared_experts:
        shared += _mlp_bytes(h, inter * cfg.n_shared_experts, s)
    per_expert = _mlp_bytes(h, inter, s)  # gate and up rows, then down: as the stacked tensors
    return shared, local_experts * per_expert


def _mlp_bytes(hidden: int, inter: int, s: _Sizes) -> int:
    return 2 * s.linear(hidden, inter) + s.linear(inter, hidden)
