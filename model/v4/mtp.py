"""DeepSeek-V4's multi-token-prediction layer (``mtp.0.*`` in the checkpoint; DeepSeek's
``MTPBlock``): from the main model's residual streams at position ``p`` (all ``hc_mult`` of them,
before the hyper-head) and the embedding of token ``p + 1``, the logits of token ``p + 2``::

    x = e_proj(enorm(embed(token p+1)))  (one vector, added to every stream)
        + h_proj(hnorm(stream))          (each stream on its own)
    x = V4 block (index num_hidden_layers: sliding window only, scored MoE; rope position p)
    logits = head(norm(own hyper-head(x)))          (embed and head shared with the main model)

Unlike V3's MTP there is no concatenation (``eh_proj``): the two projections are summed. The
block keeps its own sliding-window state per request (:class:`~tandem.model.v4.attention.
LayerState`). Its output streams are what a second draft step would take in place of the main
model's."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.model.v4.attention import LayerState, rms_norm
from tandem.model.v4.config import V4Config
from tandem.model.v4.hyper import HyperHead
from tandem.model.v4.layer import Step, V4Layer
from tandem.model.v4.projection import Projections, add_weight


class V4MTP(nn.Module):
    def __init__(self, cfg: V4Config, dtype: torch.dtype, device: torch.device | str, experts: range) -> None:
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.layer = V4Layer(cfg, cfg.num_hidden_layers, dtype, device, experts)

        def norm() -> nn.Parameter:
            return nn.Parameter(torch.empty(h, device=device), requires_grad=False)

        self.enorm, self.hnorm, self.norm = norm(), norm(), norm()
        self.proj = Projections(cfg.quant_block_size)
        for name in ("e_proj", "h_proj"):
            add_weight(self, name, h, h, dtype, device, cfg.quant_block_size)
        self.hc_head = HyperHead(cfg.hc_mult, h, cfg.hc_eps, cfg.rms_norm_eps, device)

    def forward(
        self,
        streams: torch.Tensor,
        step: Step,
        embed: torch.Tensor,
        states: list[LayerState],
        rope: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``streams [T, hc_mult, D]``: the main model's at ``step.positions`` (request after
        request, with each request's MTP state); ``step.input_ids``: the token after each. ->
        ``(hidden [T, D]`` after the final norm, for the shared head; the streams after the
        block``)``."""
        eps = self.cfg.rms_norm_eps
        e = self.proj(self, "e_proj", rms_norm(F.embedding(step.input_ids, embed), self.enorm, eps), step.ops)
        x = e.unsqueeze(1) + self.proj(self, "h_proj", rms_norm(streams, self.hnorm, eps), step.ops)
        x = self.layer(x, step, states, rope)
        return rms_norm(self.hc_head(x), self.norm, eps), x
