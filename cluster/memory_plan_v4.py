"""How a DeepSeek-V4 rank's GPU memory divides (torch-free), the V4 case of
``cluster/memory_plan.py``::

    usable     = gpu_memory_gib x 2**30 x utilization
    state      = max_num_seqs x (a request's window pages + its compressors' open windows
                                 + with MTP drafts, the MTP layer's window)
                 + transfer slots x a slot's bytes (disaggregated ranks: the bounded state of
                   the requests whose transfers are in flight, ``kv_layout.transfer_slots``)
    kv_pages   = floor((usable - weight_bytes - workspace_bytes - state) / kv_page_bytes)

``kv_page_bytes`` is one page of the kinds that grow with a request (compressed entries, the
indexer's keys, the overlap; ``model/v4/kv_layout.py``), every layer, and the page's tokens'
window KV: the pools cache prefixes, and a prefix-cache hit restores its window from its pages
(the engine keeps it there with prefix caching on, as it is by default). A page holds the least
common multiple of the pool's ``page_size`` and every compression rate (a page boundary is a
compression boundary). ``weight_bytes`` counts the weights as the checkpoint ships them,
resident (FP8 attention and shared experts, FP4 routed experts: ``model/v4/rank_weights.py``).
"""

from __future__ import annotations

from tandem.model.rank_weights import dtype_bytes
from tandem.model.v4.config import V4Config

FLOAT32_BYTES = 4


def v4_workspace_bytes(cfg: V4Config, dtype: str, rows: int, logit_rows: int) -> int:
    """An estimate of a step's activations, as V3's (``memory_plan.workspace_bytes``): per row,
    the residual's ``hc_mult`` streams in and out (float32 mixes aside), plus the largest of one
    layer's intermediates: attention (the heads' queries and outputs, ``2 x heads x head_dim``,
    and the grouped projection's ``o_groups x o_lora_rank``) or the MoE at balanced routing
    (each row's ``k`` copies sent, received and returned, their gate, up and product, and the
    shared expert's); plus the logits' rows and the two float32 rope tables. Not counted: the
    indexer's scores (its kernel works on a tile of entries at a time), kernels' scratch."""
    h, heads = cfg.hidden_size, cfg.num_attention_heads
    attention = 2 * heads * cfg.head_dim + cfg.o_groups * cfg.o_lora_rank
    inter = cfg.moe_intermediate_size
    moe = cfg.num_experts_per_tok * 3 * (h + inter) + 3 * inter
    per_row = 2 * cfg.hc_mult * h + max(attention, moe)
    item = dtype_bytes(dtype)
    logits = logit_rows * cfg.vocab_size * (item + 2 * FLOAT32_BYTES)
    rope = 2 * cfg.max_position_embeddings * cfg.qk_rope_head_dim * FLOAT32_BYTES
    return rows * per_row * item + logits + rope


def v4_mtp_state_bytes(cfg: V4Config, item_bytes: int) -> int:
    """A request's MTP-layer state on a rank that drafts with MTP (or prefills for one): that
    layer's sliding window, ``sliding_window - 1`` tokens' KV."""
    return (cfg.sliding_window - 1) * cfg.head_dim * item_bytes
