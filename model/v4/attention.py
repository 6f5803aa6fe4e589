"""DeepSeek-V4 attention for one layer: every query head attends to one shared KV head (K = V,
``head_dim`` wide, the last ``qk_rope_head_dim`` dims rotated), over

- the sliding window: the last ``sliding_window`` tokens up to and including the query's own,
- on CSA layers, the compressed entries the indexer picked for the query,
- on HCA layers, every compressed entry whose window is complete,

with a learned per-head sink logit in the softmax (it takes probability, adds no value). The
output's rope dims are rotated back by the query's position, then the heads go through the
grouped low-rank output projection (``o_groups`` groups, each to ``o_lora_rank``, then mixed).

A request's :class:`LayerState` carries the window's last ``sliding_window - 1`` keys and the
compressors' states between forward calls."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from tandem.model.v4.compressor import Compressor, CompressorState
from tandem.model.v4.config import CSA, V4Config
from tandem.model.v4.hyper import unweighted_rms_norm
from tandem.model.v4.indexer import Indexer
from tandem.model.v4.rope import rotate_tail


@dataclass
class LayerState:
    """One request's state in one layer."""

    window: torch.Tensor | None = None  # [<= sliding_window - 1, head_dim]
    compressor: CompressorState = field(default_factory=CompressorState)
    indexer: CompressorState = field(default_factory=CompressorState)
    # with pages kept (``model/v4/pages.py``): the KV of the tokens since the last page taken
    open_page: torch.Tensor | None = None
    keep_pages: bool = False


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32 with a float32 weight, cast back once (the model's own rule)."""
    h = x.float()
    return (weight.float() * (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


class V4Attention(nn.Module):
    def __init__(self, cfg: V4Config, layer: int, dtype: torch.dtype, device: torch.device | str) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.kind = cfg.layer_types[layer]
        self.rate = cfg.compress_rate(layer)
        h, hd, heads = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads

        def param(*shape: int, float32: bool = False) -> nn.Parameter:
            return nn.Parameter(
                torch.empty(*shape, dtype=torch.float32 if float32 else dtype, device=device),
                requires_grad=False,
            )

        self.wq_a = param(cfg.q_lora_rank, h)
        self.q_norm = param(cfg.q_lora_rank, float32=True)
        self.wq_b = param(heads * hd, cfg.q_lora_rank)
        self.wkv = param(hd, h)
        self.kv_norm = param(hd, float32=True)
        self.wo_a = param(cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups)
        self.wo_b = param(h, cfg.o_groups * cfg.o_lora_rank)
        self.attn_sink = param(heads, float32=True)
        eps = cfg.rms_norm_eps
        self.compressor = Compressor(h, hd, self.rate, self.kind == CSA, eps, device) if self.rate else None
        self.indexer = (
            Indexer(
                h,
                cfg.q_lora_rank,
                cfg.index_n_heads,
                cfg.index_head_dim,
                self.rate,
                cfg.index_topk,
                eps,
                dtype,
                device,
            )
            if self.kind == CSA
            else None
        )

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        query_lens: list[int],
        states: list[LayerState],
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """``x [T, D]``: the step's tokens, request after request (``query_lens`` each, with
        their ``states``); ``cos, sin``: this layer's rope tables, whole."""
        cfg = self.cfg
        t, heads, hd = x.shape[0], cfg.num_attention_heads, cfg.head_dim
        c, s = cos[positions], sin[positions]
        q_residual = rms_norm(x @ self.wq_a.t(), self.q_norm, cfg.rms_norm_eps)
        q = unweighted_rms_norm((q_residual @ self.wq_b.t()).view(t, heads, hd), cfg.rms_norm_eps)
        q = rotate_tail(q, c, s)
        kv = rotate_tail(rms_norm(x @ self.wkv.t(), self.kv_norm, cfg.rms_norm_eps), c, s)
        out = torch.empty_like(q)
        start = 0
        for n, state in zip(query_lens, states, strict=True):
            rows = slice(start, start + n)
            out[rows] = self._request(
                x[rows], q[rows], kv[rows], q_residual[rows], positions[rows], state, cos, sin
            )
            start += n
        out = rotate_tail(out, c, -s)
        groups = out.view(t, cfg.o_groups, heads * hd // cfg.o_groups).transpose(0, 1)  # [G, T, H * hd / G]
        wo_a = self.wo_a.view(cfg.o_groups, cfg.o_lora_rank, -1)
        grouped = torch.bmm(groups, wo_a.transpose(1, 2)).transpose(0, 1).flatten(1)  # [T, G * o_lora_rank]
        return grouped @ self.wo_b.t()

    def _request(
        self,
        x: torch.Tensor,
        q: torch.Tensor,
        kv: torch.Tensor,
        q_residual: torch.Tensor,
        positions: torch.Tensor,
        state: LayerState,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """One request's new tokens: its attention output ``[n, H, hd]``; its state moves on."""
        cfg = self.cfg
        past = state.window if state.window is not None else kv[:0]
        keys = torch.cat([past, kv])
        key_pos = torch.arange(keys.shape[0], device=x.device) + (positions[0] - past.shape[0])
        bias = torch.where(
            (key_pos[None, :] <= positions[:, None])
            & (key_pos[None, :] > positions[:, None] - cfg.sliding_window),
            0.0,
            float("-inf"),
        )
        keep = cfg.sliding_window - 1
        state.window = keys[max(keys.shape[0] - keep, 0) :] if keep else keys[:0]
        if state.keep_pages:
            state.open_page = kv if state.open_page is None else torch.cat([state.open_page, kv])
        if self.compressor is not None:
            entries = self.compressor(state.compressor, x, cos, sin, kv.dtype)
            visible = (
                torch.arange(entries.shape[0], device=x.device)[None, :]
                < ((positions + 1) // self.rate)[:, None]
            )
            if self.indexer is not None:
                chosen = self.indexer(state.indexer, x, q_residual, positions, cos, sin)
                # the chosen entries, and one column past the last for the "none" (-1) picks
                picked = visible.new_zeros(visible.shape[0], visible.shape[1] + 1)
                picked.scatter_(1, torch.where(chosen >= 0, chosen, visible.shape[1]), True)
                visible = visible & picked[:, :-1]
            keys = torch.cat([keys, entries])
            bias = torch.cat([bias, torch.where(visible, 0.0, float("-inf"))], dim=1)
        logits = torch.einsum("nhd,kd->nhk", q, keys) * cfg.head_dim**-0.5 + bias[:, None, :]
        sink = self.attn_sink.view(1, -1, 1).expand(logits.shape[0], -1, 1).to(logits.dtype)
        combined = torch.cat([logits, sink], dim=-1)
        combined = combined - combined.max(dim=-1, keepdim=True).values
        probs = torch.softmax(combined, dim=-1)[..., :-1].to(keys.dtype)
        return torch.einsum("nhk,kd->nhd", probs, keys)
