"""The ``torch`` kernel backend: the reference implementation of every hot op."""

from __future__ import annotations

from tandem.model.kernels.backend import KernelBackend
from tandem.model.kernels.fp8 import fp8_linear_torch
from tandem.model.kernels.mla_attention import decode_attention_torch, extend_attention_torch, kv_store_torch
from tandem.model.kernels.moe import fused_experts_torch, grouped_topk_torch
from tandem.model.kernels.norm import rms_norm_torch
from tandem.model.kernels.rope import apply_rope_torch
from tandem.model.kernels.v4_attention import (
    compress_windows_torch,
    indexer_topk_torch,
    sparse_attention_torch,
)


class TorchBackend(KernelBackend):
    name = "torch"
    rms_norm = staticmethod(rms_norm_torch)
    rope = staticmethod(apply_rope_torch)
    kv_store = staticmethod(kv_store_torch)
    extend_attention = staticmethod(extend_attention_torch)
    decode_attention = staticmethod(decode_attention_torch)
    moe_route = staticmethod(grouped_topk_torch)
    moe_experts = staticmethod(fused_experts_torch)
    fp8_linear = staticmethod(fp8_linear_torch)
    sparse_attention = staticmethod(sparse_attention_torch)
    indexer_topk = staticmethod(indexer_topk_torch)
    compress_windows = staticmethod(compress_windows_torch)
