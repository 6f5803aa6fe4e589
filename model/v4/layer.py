"""One DeepSeek-V4 block: attention then MoE, each wrapped in a hyper-connection over the
``hc_mult`` residual streams. The main model stacks ``num_hidden_layers`` of them; the MTP layer
(``model/v4/mtp.py``) is one more, at index ``num_hidden_layers`` (sliding window, scored MoE)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tandem.model.expert_dispatch import ExpertDispatcher
from tandem.model.kernels.backend import KernelBackend
from tandem.model.v4.attention import LayerState, V4Attention, rms_norm
from tandem.model.v4.config import V4Config
from tandem.model.v4.hyper import HyperConnection, spread
from tandem.model.v4.moe import V4MoE


@dataclass(frozen=True)
class Step:
    """What every layer of one forward call shares: the step's token ids (a hash MoE layer
    routes by them), positions and per-request counts, the kernel backend and the experts'
    dispatcher."""

    input_ids: torch.Tensor
    positions: torch.Tensor
    query_lens: list[int]
    ops: KernelBackend
    dispatcher: ExpertDispatcher


class V4Layer(nn.Module):
    def __init__(
        self, cfg: V4Config, index: int, dtype: torch.dtype, device: torch.device | str, experts: range
    ) -> None:
        super().__init__()
        self.cfg, self.index = cfg, index
        self.attn = V4Attention(cfg, index, dtype, device)
        self.ffn = V4MoE(cfg, index, dtype, device, experts)
        self.attn_norm = nn.Parameter(torch.empty(cfg.hidden_size, device=device), requires_grad=False)
        self.ffn_norm = nn.Parameter(torch.empty(cfg.hidden_size, device=device), requires_grad=False)
        hc = (cfg.hc_mult, cfg.hidden_size, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps, device)
        self.hc_attn = HyperConnection(*hc)
        self.hc_ffn = HyperConnection(*hc)

    def forward(
        self,
        streams: torch.Tensor,
        step: Step,
        states: list[LayerState],
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        """``streams [T, hc_mult, D]`` of the step's tokens (request after request, with each
        request's state of this layer) -> the streams after this block. ``rope``: this layer's
        ``(cos, sin)`` tables, whole."""
        eps = self.cfg.rms_norm_eps
        post, comb, collapsed = self.hc_attn(streams)
        x = rms_norm(collapsed, self.attn_norm, eps)
        out = self.attn(x, step.positions, step.query_lens, states, *rope, step.ops)
        streams = spread(post, comb, out, streams)
        post, comb, collapsed = self.hc_ffn(streams)
        out = self.ffn(rms_norm(collapsed, self.ffn_norm, eps), step.input_ids, step.ops, step.dispatcher)
        return spread(post, comb, out, streams)
