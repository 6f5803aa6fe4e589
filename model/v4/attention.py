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
from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.model.v4.compressor import Compressor, CompressorState
from tandem.model.v4.config import CSA, V4Config
from tandem.model.v4.hyper import unweighted_rms_norm
from tandem.model.v4.indexer import Indexer
from tandem.model.v4.projection import Projections, add_weight
from tandem.model.v4.rope import rotate_tail

if TYPE_CHECKING:
    from tandem.model.kernels.backend import KernelBackend


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
        self.kind = cfg.layer_type(layer)
        self.rate = cfg.compress_rate(layer)
        h, hd, heads = cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads

        def param(*shape: int, float32: bool = False) -> nn.Parameter:
            return nn.Parameter(
                torch.empty(*shape, dtype=torch.float32 if float32 else dtype, device=device),
                requires_grad=False,
            )

        block = cfg.quant_block_size
        if block and cfg.o_lora_rank % block[0]:
            raise ValueError(
                f"o_lora_rank {cfg.o_lora_rank} is not a multiple of the FP8 block's {block[0]} rows: "
                "the grouped output projection's groups would share scale blocks"
            )
        self.proj = Projections(block)
        for name, out_dim, in_dim in (
            ("wq_a", cfg.q_lora_rank, h),
            ("wq_b", heads * hd, cfg.q_lora_rank),
            ("wkv", hd, h),
            ("wo_a", cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups),
            ("wo_b", h, cfg.o_groups * cfg.o_lora_rank),
        ):
            add_weight(self, name, out_dim, in_dim, dtype, device, block)
        self.q_norm = param(cfg.q_lora_rank, float32=True)
        self.kv_norm = param(hd, float32=True)
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
                block,
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
        ops: KernelBackend,
    ) -> torch.Tensor:
        """``x [T, D]``: the step's tokens, request after request (``query_lens`` each, with
        their ``states``); ``cos, sin``: this layer's rope tables, whole.

        Each request's window keys and compressed entries go into one key buffer for the step,
        and each query row gets the list of the buffer rows it sees; one ``sparse_attention``
        call (and on CSA layers one ``indexer_topk``) serves the whole step."""
        cfg = self.cfg
        t, heads, hd = x.shape[0], cfg.num_attention_heads, cfg.head_dim
        c, s = cos[positions], sin[positions]
        proj = self.proj
        q_residual = rms_norm(proj(self, "wq_a", x, ops), self.q_norm, cfg.rms_norm_eps)
        q = unweighted_rms_norm(proj(self, "wq_b", q_residual, ops).view(t, heads, hd), cfg.rms_norm_eps)
        q = rotate_tail(q, c, s)
        kv = rotate_tail(rms_norm(proj(self, "wkv", x, ops), self.kv_norm, cfg.rms_norm_eps), c, s)
        step = _StepKeys()
        start = 0
        for n, state in zip(query_lens, states, strict=True):
            rows = slice(start, start + n)
            self._advance(step, state, x[rows], kv[rows], cos, sin, ops)
            start += n
        indices = step.window_indices(positions, query_lens, cfg.sliding_window)
        if self.compressor is not None:
            if self.indexer is not None:
                chosen = self.indexer.choose(
                    x,
                    q_residual,
                    positions,
                    cos,
                    sin,
                    step.index_keys(kv),
                    step.rows(step.index_starts, query_lens, x.device),
                    max(step.index_counts, default=0),
                    ops,
                )
            else:
                chosen = _all_visible((positions + 1) // self.rate, max(step.entry_counts, default=0))
            first = step.rows(step.entry_starts, query_lens, x.device)
            indices = torch.cat([indices, torch.where(chosen >= 0, chosen + first[:, None], -1)], dim=1)
        out = ops.sparse_attention(q, step.keys(kv), indices.to(torch.int32), self.attn_sink, hd**-0.5)
        out = rotate_tail(out, c, -s)
        groups = out.view(t, cfg.o_groups, heads * hd // cfg.o_groups).transpose(0, 1)  # [G, T, H * hd / G]
        grouped = proj.grouped(self, "wo_a", groups, cfg.o_groups, ops).transpose(0, 1).flatten(1)
        return proj(self, "wo_b", grouped, ops)  # from [T, G * o_lora_rank]

    def _advance(
        self,
        step: _StepKeys,
        state: LayerState,
        x: torch.Tensor,
        kv: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        ops: KernelBackend,
    ) -> None:
        """One request's new tokens: its keys (window, then compressed entries) into ``step``;
        its state moves on past them."""
        cfg = self.cfg
        past = state.window if state.window is not None else kv[:0]
        keys = torch.cat([past, kv])
        step.add_window(keys, past.shape[0])
        keep = cfg.sliding_window - 1
        window = keys[max(keys.shape[0] - keep, 0) :] if keep else keys[:0]
        # a view keeps its whole base alive: past a step of more new tokens than the window, a copy
        state.window = window.clone() if kv.shape[0] > keep else window
        if state.keep_pages:
            state.open_page = kv if state.open_page is None else torch.cat([state.open_page, kv])
        if self.compressor is not None:
            step.add_entries(self.compressor(state.compressor, x, cos, sin, kv.dtype, ops))
        if self.indexer is not None:
            step.add_index_keys(self.indexer.keys(state.indexer, x, cos, sin, kv.dtype, ops))


def _all_visible(visible: torch.Tensor, width: int) -> torch.Tensor:
    """HCA: every complete window's entry, ``[T, width]`` (``width``: the most a row sees, from
    the host; ``-1`` past a row's)."""
    entries = torch.arange(width, device=visible.device)[None, :]
    return torch.where(entries < visible[:, None], entries, -1)


class _StepKeys:
    """The step's key buffer: per request its window keys (the past ``sliding_window - 1`` and
    its new tokens) then its compressed entries; and the step's indexer keys, request after
    request. Offsets are kept per request and spread to its rows."""

    def __init__(self) -> None:
        self.parts: list[torch.Tensor] = []
        self.index_parts: list[torch.Tensor] = []
        self.window_starts: list[int] = []  # buffer row of the request's first window key
        self.pasts: list[int] = []  # window keys before its first new token
        self.entry_starts: list[int] = []
        self.index_starts: list[int] = []
        # each request's entries (indexer keys) after this step: what its last row sees
        self.entry_counts: list[int] = []
        self.index_counts: list[int] = []
        self.size = self.index_size = 0

    def add_window(self, keys: torch.Tensor, past: int) -> None:
        self.window_starts.append(self.size)
        self.pasts.append(past)
        self.parts.append(keys)
        self.size += keys.shape[0]

    def add_entries(self, entries: torch.Tensor) -> None:
        self.entry_starts.append(self.size)
        self.entry_counts.append(entries.shape[0])
        self.parts.append(entries)
        self.size += entries.shape[0]

    def add_index_keys(self, keys: torch.Tensor) -> None:
        self.index_starts.append(self.index_size)
        self.index_counts.append(keys.shape[0])
        self.index_parts.append(keys)
        self.index_size += keys.shape[0]

    def keys(self, like: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.parts) if self.parts else like[:0]

    def index_keys(self, like: torch.Tensor) -> torch.Tensor:
        return torch.cat(self.index_parts) if self.index_parts else like[:0]

    @staticmethod
    def rows(per_request: list[int], query_lens: list[int], device: torch.device) -> torch.Tensor:
        """A number per request, spread to its rows: ``[T]``."""
        counts = torch.tensor(query_lens, dtype=torch.int64)
        return torch.tensor(per_request, dtype=torch.int64).repeat_interleave(counts).to(device)

    def window_indices(self, positions: torch.Tensor, query_lens: list[int], window: int) -> torch.Tensor:
        """``[T, window]``: row ``t`` (a request's ``i``-th new token) sees its request's window
        keys ``past + i - window + 1 .. past + i`` (``-1`` before the first)."""
        device = positions.device
        first = self.rows(self.window_starts, query_lens, device)
        within = (
            torch.cat([torch.arange(n, device=device) for n in query_lens]) if query_lens else positions[:0]
        )
        last = self.rows(self.pasts, query_lens, device) + within  # the row's own key, in its request
        offsets = last[:, None] - window + 1 + torch.arange(window, device=device)[None, :]
        return torch.where(offsets >= 0, offsets + first[:, None], -1)
