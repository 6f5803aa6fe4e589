"""The ``triton`` kernel backend: every hot op as a Triton kernel (compiled on a GPU, run in
Triton's interpreter on a CPU)."""

from __future__ import annotations

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


class TritonBackend(KernelBackend):
    name = "triton"
    rms_norm = staticmethod(rms_norm_triton)
    rope = staticmethod(apply_rope_triton)
    kv_store = staticmethod(kv_store_triton)
    rope_kv_store = staticmethod(rope_kv_store_triton)
    extend_attention = staticmethod(extend_attention_triton)
    decode_attention = staticmethod(decode_attention_triton)
    moe_route = staticmethod(grouped_topk_triton)
    moe_gate_route = staticmethod(gate_route_triton)
    moe_experts = staticmethod(fused_experts_triton)
    fp8_linear = staticmethod(fp8_linear_triton)
