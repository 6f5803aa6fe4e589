"""DeepSeek-V3's multi-token-prediction (MTP) layer, its first depth, as a drafter runs it.

The checkpoint ships it as layer ``N = num_hidden_layers``: its own token embedding, the norms
of its two inputs and their projection, one full decoder layer (MLA attention with a KV cache of
its own, the pool's layer ``N``, and an MoE block) and an output head. Row ``p`` combines the
token at ``p + 1`` with a hidden state of position ``p`` and predicts the token at ``p + 2``::

    e = enorm(embed(t[p+1]))   (zero at position 0, as vLLM and SGLang run it)
    h = hnorm(hidden[p])       the target's last hidden state after its final norm; in a chain,
                               the MTP layer's own output at p
    x = eh_proj([e ; h])  ->  decoder layer at position p  ->  g[p]     (kept for the chain)
    logits = head(norm(g[p]))

Rows are a ragged batch over the paged pool, exactly as the main layers' are.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.model.attention_metadata import AttentionMetadata
from tandem.model.config import ModelConfig
from tandem.model.expert_dispatch import ExpertDispatcher
from tandem.model.kernels.backend import KernelBackend
from tandem.model.kv_pool import KVPool
from tandem.model.layers import DecoderLayer, Linear, MoE, RMSNorm


class MTPLayer(nn.Module):
    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype,
        device: torch.device | str,
        experts: range,
        fp8_block: tuple[int, int] | None = None,
    ) -> None:
        """``fp8_block``: the decoder layer's projections and experts stay FP8 (``layers.py``);
        ``eh_proj`` is in the model dtype."""
        super().__init__()
        h = cfg.hidden_size
        self.index = cfg.num_hidden_layers  # its layer in the checkpoint and in the KV pool
        self.embed_tokens = nn.Parameter(torch.empty(cfg.vocab_size, h, dtype=dtype, device=device), False)
        self.enorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.hnorm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.eh_proj = Linear(2 * h, h, False, dtype, device)
        self.layer = DecoderLayer(cfg, self.index, dtype, device, experts, fp8_block)
        self.shared_head_norm = RMSNorm(h, cfg.rms_norm_eps, dtype, device)
        self.shared_head = nn.Parameter(torch.empty(cfg.vocab_size, h, dtype=dtype, device=device), False)
        self.experts = experts

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        pool: KVPool,
        ops: KernelBackend,
        dispatcher: ExpertDispatcher,
        on_layer_kv: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """``g [T, hidden]`` for the packed rows (see the module docstring); the layer's KV for
        every row lands in the pool's layer ``index`` (``on_layer_kv(index)`` once it has)."""
        layer = self.layer
        e = F.embedding(input_ids, self.embed_tokens)
        e = e.masked_fill((positions == 0)[:, None], 0.0)
        e = ops.rms_norm(e, self.enorm.weight, self.enorm.eps)[0]
        h = ops.rms_norm(hidden.to(e.dtype), self.hnorm.weight, self.hnorm.eps)[0]
        x = self.eh_proj(torch.cat([e, h], dim=-1))
        h, residual = ops.rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps)
        x = layer.self_attn(h, cos, sin, pool.layer(self.index), meta, ops)
        if on_layer_kv is not None:
            on_layer_kv(self.index)
        h, residual = ops.rms_norm(
            x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, residual
        )
        x = layer.mlp(h, ops, dispatcher) if isinstance(layer.mlp, MoE) else layer.mlp(h)
        return x + residual

    def compute_logits(self, g: torch.Tensor, ops: KernelBackend) -> torch.Tensor:
        return F.linear(
            ops.rms_norm(g, self.shared_head_norm.weight, self.shared_head_norm.eps)[0], self.shared_head
        )
