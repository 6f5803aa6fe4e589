"""The ``triton`` kernel backend: every hot op as a Triton kernel (compiled on a GPU, run in
Triton's interpreter on a CPU)."""

from __future__ import annotations

import torch

from tandem.model.kernels.backend import KernelBackend
from tandem.model.kernels.fp8_gemm_triton import fp8_linear_triton
from tandem.model.kernels.kv_store_triton import kv_store_triton
from tandem.model.kernels.mla_decode_triton import decode_attention_triton
from tandem.model.kernels.mla_extend_triton import extend_attention_triton
from tandem.model.kernels.moe_experts_triton import fused_experts_triton
from tandem.model.kernels.moe_gate_route_triton import gate_route_triton
from tandem.model.kernels.moe_route_triton import grouped_topk_triton
from tandem.model.kernels.norm_triton import rms_norm_triton
from tandem.model.kernels.rope_kv_store_triton import rope_kv_store_triton
from tandem.model.kernels.rope_triton import apply_rope_triton
from tandem.model.kernels.tuning import fused_gate_route_min_tokens
from tandem.model.kernels.v4_attention_triton import sparse_attention_triton
from tandem.model.kernels.v4_compress_triton import compress_windows_triton
from tandem.model.kernels.v4_indexer_triton import indexer_topk_triton


class TritonBackend(KernelBackend):
    name = "triton"
    rms_norm = staticmethod(rms_norm_triton)
    rope = staticmethod(apply_rope_triton)
    kv_store = staticmethod(kv_store_triton)
    rope_kv_store = staticmethod(rope_kv_store_triton)
    extend_attention = staticmethod(extend_attention_triton)
    decode_attention = staticmethod(decode_attention_triton)
    moe_route = staticmethod(grouped_topk_triton)
    moe_experts = staticmethod(fused_experts_triton)
    fp8_linear = staticmethod(fp8_linear_triton)
    sparse_attention = staticmethod(sparse_attention_triton)
    indexer_topk = staticmethod(indexer_topk_triton)
    compress_windows = staticmethod(compress_windows_triton)

    def moe_gate_route(
        self,
        x: torch.Tensor,
        gate_weight: torch.Tensor,
        correction_bias: torch.Tensor,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The fused kernel from this GPU kind's batch up (``tuning.fused_gate_route_min_tokens``);
        a smaller batch keeps the two steps, whose GEMM spreads over every SM."""
        args = (
            x,
            gate_weight,
            correction_bias,
            top_k,
            n_group,
            topk_group,
            norm_topk_prob,
            routed_scaling_factor,
        )
        if x.shape[0] < fused_gate_route_min_tokens():
            return super().moe_gate_route(*args)
        return gate_route_triton(*args)
