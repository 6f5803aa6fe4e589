"""DeepSeek-V4's MoE, in every layer: routed experts chosen by a frozen token-id -> experts table
on ``hash_moe`` layers, by the top scores (``sqrtsoftplus`` by default) plus the correction bias
on the others; the chosen experts' scores, normalised and scaled, weigh their outputs. The
routed experts' and the shared expert's gate and up projections are clipped at
``swiglu_limit`` (the gate from above, the up on both sides) before SiLU(gate) * up."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.model.expert_dispatch import ExpertDispatcher, Routed
from tandem.model.kernels.backend import KernelBackend
from tandem.model.kernels.fp4 import fp4_shapes
from tandem.model.kernels.fp8 import FP8_DTYPE, scale_shape
from tandem.model.kernels.moe import ExpertScales
from tandem.model.v4.config import V4Config
from tandem.model.v4.projection import Projections, add_weight


def score(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if func == "sigmoid":
        return logits.sigmoid()
    return logits.softmax(dim=-1)


def clipped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class V4MoE(nn.Module):
    """Routed experts ``first_expert ..`` (``w_gate_up [E, 2I, D]``: gate rows then up rows,
    ``w_down [E, D, I]``) and the shared expert (``w1``, ``w3`` gate and up, ``w2`` down). The
    routed experts run where an :class:`~tandem.model.expert_dispatch.ExpertDispatcher` puts
    them, clipped (``swiglu_limit``) by the kernel backend's ``moe_experts``. From an FP8
    checkpoint every one of them stays FP8 with its block scales; routed experts shipped FP4
    (``expert_dtype`` ``fp4``) stay FP4, bytes and scale bytes (``kernels/fp4.py``)."""

    def __init__(
        self, cfg: V4Config, layer: int, dtype: torch.dtype, device: torch.device | str, experts: range
    ) -> None:
        super().__init__()
        self.cfg, self.hash = cfg, cfg.is_hash_layer(layer)
        self.first_expert = experts.start
        h, inter, e = cfg.hidden_size, cfg.moe_intermediate_size, len(experts)

        def param(*shape: int, dt: torch.dtype = dtype) -> nn.Parameter:
            return nn.Parameter(torch.empty(*shape, dtype=dt, device=device), requires_grad=False)

        self.gate_weight = param(cfg.n_routed_experts, h)
        if self.hash:
            self.tid2eid = param(cfg.vocab_size, cfg.num_experts_per_tok, dt=torch.int64)
        else:
            self.gate_bias = param(cfg.n_routed_experts, dt=torch.float32)
        block = self.block = cfg.quant_block_size
        self.fp4 = cfg.expert_dtype == "fp4"
        self.proj = Projections(block)
        if self.fp4:  # bytes, two weights each, and a scale byte per 32 (``kernels/fp4.py``)
            (_, half_h), (_, groups_h) = fp4_shapes(2 * inter, h)
            (_, half_i), (_, groups_i) = fp4_shapes(h, inter)
            self.w_gate_up = param(e, 2 * inter, half_h, dt=torch.uint8)
            self.w_down = param(e, h, half_i, dt=torch.uint8)
            self.w_gate_up_scale = param(e, 2 * inter, groups_h, dt=torch.uint8)
            self.w_down_scale = param(e, h, groups_i, dt=torch.uint8)
        else:
            self.w_gate_up = param(e, 2 * inter, h, dt=FP8_DTYPE if block else dtype)
            self.w_down = param(e, h, inter, dt=FP8_DTYPE if block else dtype)
        if block and not self.fp4:  # gate's scale rows then up's, as the stack holds them
            self.w_gate_up_scale = param(e, 2 * -(-inter // block[0]), -(-h // block[1]), dt=torch.float32)
            self.w_down_scale = param(e, *scale_shape(h, inter, block), dt=torch.float32)
        for name, out_dim, in_dim in (("w1", inter, h), ("w3", inter, h), ("w2", h, inter)):
            add_weight(self, name, out_dim, in_dim, dtype, device, block)

    def route(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(weights [T, k] float32, expert ids [T, k])``."""
        cfg = self.cfg
        scores = score(x @ self.gate_weight.t(), cfg.scoring_func)
        if self.hash:
            ids = self.tid2eid[input_ids]
        else:
            ids = torch.topk(scores + self.gate_bias, cfg.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return (weights * cfg.routed_scaling_factor).float(), ids

    @property
    def expert_scales(self) -> ExpertScales | None:
        """FP4 experts' scale bytes, FP8 experts' block scales (dequantised per tile: clipped
        experts take no FP8 activations), or ``None``."""
        if self.fp4:
            return ExpertScales.fp4(self.w_gate_up_scale, self.w_down_scale)
        if self.block is None:
            return None
        return ExpertScales(self.w_gate_up_scale, self.w_down_scale, self.block, "dequant")

    @property
    def swiglu_limit(self) -> float:
        return self.cfg.swiglu_limit

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor, ops: KernelBackend, dispatcher: ExpertDispatcher
    ) -> torch.Tensor:
        """The routed experts through ``dispatcher`` (this process's, or the DEP group's by
        all-to-all: an idle rank still serves the others' rows), plus the shared expert."""
        if x.shape[0]:
            weights, ids = self.route(x, input_ids)
        else:
            k = self.cfg.num_experts_per_tok
            weights = torch.empty((0, k), dtype=torch.float32, device=x.device)
            ids = torch.empty((0, k), dtype=torch.int64, device=x.device)
        out = dispatcher.routed_experts(self, Routed(x, weights, ids), ops)
        limit, proj = self.cfg.swiglu_limit, self.proj
        shared = clipped_swiglu(proj(self, "w1", x, ops), proj(self, "w3", x, ops), limit)
        return out + proj(self, "w2", shared, ops)
