"""DeepSeek-V3 layers over a ragged batch: MLA attention, the dense MLP and the MoE block.

Parameters keep the Hugging Face names and shapes (``q_a_proj``, ``kv_b_proj``, ...) so a
checkpoint loads by name, except the routed experts, which are stacked for grouped compute:
``w_gate_up [E_local, 2I, D]`` (gate rows then up rows) and ``w_down [E_local, D, I]``.

With ``fp8_block`` (an FP8 checkpoint's block size) the projections keep the checkpoint's FP8
weights with their ``weight_scale_inv`` (``kernels/fp8.py``) and multiply through the backend's
block-scaled GEMM; so do the routed experts (``w_gate_up_scale``, ``w_down_scale``). Norms, the
router and ``kv_b_proj`` (split into the absorbed decode weights every step) stay in the model
dtype: an FP8 ``kv_b_proj`` is dequantised at load, as SGLang and vLLM do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.model.attention_metadata import AttentionMetadata
from tandem.model.config import ModelConfig
from tandem.model.expert_dispatch import ExpertDispatcher, Routed
from tandem.model.kernels.backend import KernelBackend
from tandem.model.kernels.fp8 import FP8_DTYPE, fp8_mode, scale_shape
from tandem.model.kernels.moe import ExpertScales

Fp8Block = tuple[int, int] | None


def _param(*shape: int, dtype: torch.dtype, device: torch.device | str) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.weight = _param(dim, dtype=dtype, device=device)
        self.eps = eps


class Linear(nn.Module):
    """``x @ weight^T + bias``; with ``fp8_block`` the weight is FP8 with its block scales, and
    ``ops`` (the model's kernel backend, set by the model) multiplies by it as it is."""

    def __init__(
        self,
        in_dim: int,
        out_dim: int,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device | str,
        fp8_block: Fp8Block = None,
    ) -> None:
        super().__init__()
        self.fp8_block = fp8_block
        self.weight = _param(out_dim, in_dim, dtype=FP8_DTYPE if fp8_block else dtype, device=device)
        self.weight_scale_inv = (
            _param(*scale_shape(out_dim, in_dim, fp8_block), dtype=torch.float32, device=device)
            if fp8_block
            else None
        )
        self.bias = _param(out_dim, dtype=dtype, device=device) if bias else None
        self.ops: KernelBackend | None = None
        self.fp8_mode = fp8_mode() if fp8_block else "dequant"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight_scale_inv is None:
            return F.linear(x, self.weight, self.bias)
        assert self.ops is not None and self.fp8_block is not None, "the model sets an FP8 layer's ops"
        return self.ops.fp8_linear(
            x, self.weight, self.weight_scale_inv, self.fp8_block, self.bias, self.fp8_mode
        )


class MLAttention(nn.Module):
    """Multi-head latent attention that reads and writes one layer of the paged latent pool."""

    def __init__(
        self, cfg: ModelConfig, dtype: torch.dtype, device: torch.device | str, fp8_block: Fp8Block = None
    ) -> None:
        super().__init__()
        self.cfg = cfg
        h, heads, bias = cfg.hidden_size, cfg.num_attention_heads, cfg.attention_bias
        q8 = fp8_block
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: Linear | None = None
        if cfg.q_lora_rank is None:
            self.q_proj = Linear(h, heads * cfg.qk_head_dim, False, dtype, device, q8)
        else:
            self.q_a_proj = Linear(h, cfg.q_lora_rank, bias, dtype, device, q8)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, 1e-6, dtype, device)
            self.q_b_proj = Linear(cfg.q_lora_rank, heads * cfg.qk_head_dim, False, dtype, device, q8)
        self.kv_a_proj_with_mqa = Linear(h, cfg.kv_cache_dim, bias, dtype, device, q8)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, 1e-6, dtype, device)
        self.kv_b_proj = Linear(
            cfg.kv_lora_rank, heads * (cfg.qk_nope_head_dim + cfg.v_head_dim), False, dtype, device
        )
        self.o_proj = Linear(heads * cfg.v_head_dim, h, bias, dtype, device, q8)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        ops: KernelBackend,
    ) -> torch.Tensor:
        cfg = self.cfg
        heads, nope, rope_dim, latent = (
            cfg.num_attention_heads,
            cfg.qk_nope_head_dim,
            cfg.qk_rope_head_dim,
            cfg.kv_lora_rank,
        )
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            qa = ops.rms_norm(self.q_a_proj(x), self.q_a_layernorm.weight, self.q_a_layernorm.eps)[0]
            q = self.q_b_proj(qa)
        q = q.view(-1, heads, cfg.qk_head_dim)
        q_nope, q_pe = q.split([nope, rope_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([latent, rope_dim], dim=-1)
        norm = self.kv_a_layernorm
        q_pe = ops.rope_kv_store(
            q_pe, k_pe, c, norm.weight, norm.eps, cos, sin, cfg.rope_interleave, kv_layer, meta.slot_mapping
        )

        out = x.new_empty((x.shape[0], heads, cfg.v_head_dim))
        w_kv_b = self.kv_b_proj.weight
        if meta.extend_rows:
            sub, idx = meta.rows(meta.extend_rows)
            q_ext = torch.cat([q_nope[idx], q_pe[idx]], dim=-1)
            out[idx] = ops.extend_attention(
                q_ext, kv_layer, sub, w_kv_b, heads, nope, cfg.v_head_dim, cfg.softmax_scale
            )
        if meta.decode_rows:
            sub, idx = meta.rows(meta.decode_rows)
            w = w_kv_b.view(heads, nope + cfg.v_head_dim, latent)
            w_uk, w_uv = w[:, :nope], w[:, nope:]
            q_latent = torch.einsum("bhn,hnl->bhl", q_nope[idx], w_uk)
            o_latent = ops.decode_attention(q_latent, q_pe[idx], kv_layer, sub, cfg.softmax_scale)
            out[idx] = torch.einsum("bhl,hvl->bhv", o_latent, w_uv)
        return self.o_proj(out.reshape(x.shape[0], heads * cfg.v_head_dim))


class DenseMLP(nn.Module):
    def __init__(
        self,
        hidden: int,
        inter: int,
        dtype: torch.dtype,
        device: torch.device | str,
        fp8_block: Fp8Block = None,
    ) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, inter, False, dtype, device, fp8_block)
        self.up_proj = Linear(hidden, inter, False, dtype, device, fp8_block)
        self.down_proj = Linear(inter, hidden, False, dtype, device, fp8_block)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MoE(nn.Module):
    """Routed experts ``first_expert .. first_expert + num_local_experts - 1`` plus the shared
    experts. The router weight and correction bias stay in float32, as the reference keeps them."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        first_expert: int = 0,
        num_local_experts: int | None = None,
        fp8_block: Fp8Block = None,
    ) -> None:
        super().__init__()
        self.cfg = cfg
        self.first_expert = first_expert
        self.num_local_experts = n = cfg.n_routed_experts if num_local_experts is None else num_local_experts
        h, inter = cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_weight = _param(cfg.n_routed_experts, h, dtype=torch.float32, device=device)
        self.e_score_correction_bias = _param(cfg.n_routed_experts, dtype=torch.float32, device=device)
        expert_dtype = FP8_DTYPE if fp8_block else dtype
        self.w_gate_up = _param(n, 2 * inter, h, dtype=expert_dtype, device=device)
        self.w_down = _param(n, h, inter, dtype=expert_dtype, device=device)
        self.fp8_block = fp8_block
        self.fp8_mode = fp8_mode() if fp8_block else "dequant"  # read once, as Linear does
        self.w_gate_up_scale: nn.Parameter | None = None
        self.w_down_scale: nn.Parameter | None = None
        if fp8_block:
            rows, cols = scale_shape(inter, h, fp8_block)
            self.w_gate_up_scale = _param(n, 2 * rows, cols, dtype=torch.float32, device=device)
            down_rows, down_cols = scale_shape(h, inter, fp8_block)
            self.w_down_scale = _param(n, down_rows, down_cols, dtype=torch.float32, device=device)
        shared = inter * cfg.n_shared_experts
        self.shared_experts = DenseMLP(h, shared, dtype, device, fp8_block) if shared else None

    swiglu_limit: float | None = None  # DeepSeek-V3's experts are not clipped

    @property
    def expert_scales(self) -> ExpertScales | None:
        if self.w_gate_up_scale is None or self.w_down_scale is None or self.fp8_block is None:
            return None
        return ExpertScales(self.w_gate_up_scale, self.w_down_scale, self.fp8_block, self.fp8_mode)

    def route(self, x: torch.Tensor, ops: KernelBackend) -> tuple[torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        return ops.moe_gate_route(
            x,
            self.gate_weight,
            self.e_score_correction_bias,
            cfg.num_experts_per_tok,
            cfg.n_group,
            cfg.topk_group,
            cfg.norm_topk_prob,
            cfg.routed_scaling_factor,
        )

    def forward(self, x: torch.Tensor, ops: KernelBackend, dispatcher: ExpertDispatcher) -> torch.Tensor:
        if x.shape[0]:
            weights, ids = self.route(x, ops)
        else:  # an idle expert-parallel rank still serves the other ranks' rows
            k = self.cfg.num_experts_per_tok
            weights = torch.empty((0, k), dtype=torch.float32, device=x.device)
            ids = torch.empty((0, k), dtype=torch.int64, device=x.device)
        out = dispatcher.routed_experts(self, Routed(x, weights, ids), ops)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


class DecoderLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        index: int,
        dtype: torch.dtype,
        device: torch.device | str,
        experts: range,
        fp8_block: Fp8Block = None,
    ) -> None:
        super().__init__()
        self.index = index
        self.self_attn = MLAttention(cfg, dtype, device, fp8_block)
        self.mlp: DenseMLP | MoE
        if cfg.is_moe_layer(index):
            self.mlp = MoE(cfg, dtype, device, experts.start, len(experts), fp8_block)
        else:
            self.mlp = DenseMLP(cfg.hidden_size, cfg.intermediate_size, dtype, device, fp8_block)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
