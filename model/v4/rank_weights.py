"""What one rank of a DEP group holds of a DeepSeek-V4 model, counted from the config alone
(torch-free), parameter by parameter as :class:`~tandem.model.v4.model.DeepseekV4` allocates
them: in the model dtype the embedding, the head and the projections; float32 the norms, the
hyper-connections, the sinks, the compressors and the indexer's head weights (the model's own
code keeps these float32); ``tid2eid`` 8-byte integers; the rank's slice of the routed experts.

With ``quantized``, the weights as the checkpoint ships them, resident: attention and shared
expert projections FP8 with float32 block scales (``quantization_config``), the routed experts
in ``expert_dtype`` (FP4: half a byte a weight and a one-byte scale per 32; FP8 as above)."""

from __future__ import annotations

import math

from tandem.model.rank_weights import FP8_BYTES, SCALE_BYTES, RankWeightBytes, dtype_bytes, expert_slice
from tandem.model.v4.config import CSA, V4Config

FLOAT32 = 4
INDEX_BYTES = 8
FP4_GROUP = 32  # weights per FP4 scale, along the input


def v4_rank_weight_bytes(
    cfg: V4Config, dtype: str, rank: int, world_size: int, quantized: bool = False, mtp: bool = False
) -> RankWeightBytes:
    """With ``mtp``, the MTP layer too (one more block, its glue and its own hyper-head)."""
    item = dtype_bytes(dtype)
    block = cfg.quant_block_size if quantized else None

    def linear(in_dim: int, out_dim: int) -> int:
        if block is None:
            return out_dim * in_dim * item
        scales = math.ceil(out_dim / block[0]) * math.ceil(in_dim / block[1]) * SCALE_BYTES
        return out_dim * in_dim * FP8_BYTES + scales

    def expert(in_dim: int, out_dim: int) -> int:
        if quantized and cfg.expert_dtype == "fp4":
            return out_dim * in_dim // 2 + out_dim * math.ceil(in_dim / FP4_GROUP)
        return linear(in_dim, out_dim)

    h, v, hd, heads, n = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.num_attention_heads, cfg.hc_mult
    inter, groups, olr = cfg.moe_intermediate_size, cfg.o_groups, cfg.o_lora_rank
    hc = ((2 + n) * n * n * h + (2 + n) * n + 3) * FLOAT32
    replicated = 2 * v * h * item + h * FLOAT32 + (n * n * h + n + 1) * FLOAT32  # embed, head, norm, hc_head
    routed = 0
    local = len(expert_slice(cfg.n_routed_experts, rank, world_size))
    if mtp:  # enorm, hnorm, norm, e_proj, h_proj, its hyper-head
        replicated += 3 * h * FLOAT32 + 2 * linear(h, h) + (n * n * h + n + 1) * FLOAT32
    for i in range(cfg.num_hidden_layers + int(mtp)):
        replicated += 2 * h * FLOAT32 + 2 * hc  # attn_norm, ffn_norm, hc_attn, hc_ffn
        replicated += linear(h, cfg.q_lora_rank) + linear(cfg.q_lora_rank, heads * hd) + linear(h, hd)
        replicated += linear(heads * hd // groups, groups * olr) + linear(groups * olr, h)
        replicated += (cfg.q_lora_rank + hd + heads) * FLOAT32  # q_norm, kv_norm, attn_sink
        rate = cfg.compress_rate(i)
        if rate:
            csa = cfg.layer_type(i) == CSA
            replicated += _compressor(h, hd, rate, csa)
            if csa:
                ihd = cfg.index_head_dim
                replicated += _compressor(h, ihd, rate, True) + linear(
                    cfg.q_lora_rank, cfg.index_n_heads * ihd
                )
                replicated += cfg.index_n_heads * h * FLOAT32  # weights_proj
        replicated += cfg.n_routed_experts * h * item  # the router
        if cfg.is_hash_layer(i):
            replicated += v * cfg.num_experts_per_tok * INDEX_BYTES
        else:
            replicated += cfg.n_routed_experts * FLOAT32
        replicated += 2 * linear(h, inter) + linear(inter, h)  # the shared expert
        routed += local * (2 * expert(h, inter) + expert(inter, h))
    return RankWeightBytes(replicated, routed)


def _compressor(hidden: int, dim: int, rate: int, overlap: bool) -> int:
    width = 2 * dim if overlap else dim
    return (2 * width * hidden + rate * width + dim) * FLOAT32
