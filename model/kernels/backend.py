"""The dispatch seam for hot operations.

Every hot op of the forward pass is called through a :class:`KernelBackend`. The ``torch``
backend holds the reference implementations (each in the file of its op); a Triton backend
registers under another name. ``TANDEM_KERNELS`` overrides the default choice.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, ClassVar

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from tandem.model.attention_metadata import AttentionMetadata
    from tandem.model.kernels.fp8 import Fp8Mode
    from tandem.model.kernels.moe import ExpertScales


class KernelBackend(ABC):
    """The hot ops. Shapes: ``T`` new tokens, ``H`` heads, ``L`` kv_lora_rank, ``R`` rope dim."""

    name: ClassVar[str]

    @abstractmethod
    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(norm(x + residual), x + residual)``; without a residual, ``(norm(x), x)``."""

    @abstractmethod
    def rope(
        self, q_pe: torch.Tensor, k_pe: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate ``q_pe [T, H, R]`` and ``k_pe [T, R]`` by per-token ``cos``/``sin`` ``[T, R/2]``."""

    @abstractmethod
    def kv_store(
        self, kv_layer: torch.Tensor, slot_mapping: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor
    ) -> None:
        """Write ``[latent | k_pe]`` of each new token into its slot of one layer's pool."""

    def rope_kv_store(
        self,
        q_pe: torch.Tensor,
        k_pe: torch.Tensor,
        latent: torch.Tensor,
        latent_norm_weight: torch.Tensor,
        eps: float,
        cos: torch.Tensor,
        sin: torch.Tensor,
        interleave: bool,
        kv_layer: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """MLA's step from projections to pool: ``rms_norm`` the latent, ``rope`` ``q_pe`` and
        ``k_pe``, ``kv_store`` ``[norm(latent) | rot(k_pe)]``; return the rotated ``q_pe``.

        The inputs are not changed. This default makes the three calls; a backend may fuse them.
        """
        latent = self.rms_norm(latent, latent_norm_weight, eps)[0]
        q_pe, k_pe = self.rope(q_pe, k_pe, cos, sin, interleave)
        self.kv_store(kv_layer, slot_mapping, latent, k_pe)
        return q_pe

    @abstractmethod
    def extend_attention(
        self,
        q: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        w_kv_b: torch.Tensor,
        num_heads: int,
        qk_nope_head_dim: int,
        v_head_dim: int,
        scale: float,
    ) -> torch.Tensor:
        """Plain MLA for the extend rows: ``q [T, H, nope+R]`` -> ``[T, H, v]``, causal over prefix + self."""

    @abstractmethod
    def decode_attention(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Absorbed MLA for single-token rows: ``q_latent [B, H, L]``, ``q_pe [B, H, R]`` -> ``[B, H, L]``."""

    @abstractmethod
    def moe_route(
        self,
        router_logits: torch.Tensor,
        correction_bias: torch.Tensor,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk_prob: bool,
        routed_scaling_factor: float,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``noaux_tc`` grouped top-k: ``(weights [T, k] float32, expert ids [T, k])``."""

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
        """The router GEMM, then ``moe_route``: logits ``x [T, D]`` widened to float32 times the
        float32 ``gate_weight [E, D]`` transposed, at full float32 precision (as Hugging Face
        computes them: one flipped expert changes the layer's output).

        This default makes the two steps; a backend may fuse them.
        """
        logits = F.linear(x.to(torch.float32), gate_weight)
        return self.moe_route(
            logits, correction_bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor
        )

    @abstractmethod
    def moe_experts(
        self,
        x: torch.Tensor,
        topk_weights: torch.Tensor,
        topk_ids: torch.Tensor,
        w_gate_up: torch.Tensor,
        w_down: torch.Tensor,
        first_expert: int,
        scales: ExpertScales | None = None,
        swiglu_limit: float | None = None,
    ) -> torch.Tensor:
        """Sum over each token's experts of ``weight * down(silu(gate(x)) * up(x))``.

        ``w_gate_up [E_local, 2I, D]`` and ``w_down [E_local, D, I]`` hold experts
        ``first_expert .. first_expert + E_local - 1``; other experts contribute nothing.
        With ``scales`` they are FP8, block-scaled (``kernels/fp8.py``). With ``swiglu_limit``
        (DeepSeek-V4) the gate is clipped from above and the up on both sides at the limit
        before ``silu(gate) * up`` (:func:`~tandem.model.kernels.moe.clip_gate_up`).
        """

    @abstractmethod
    def fp8_linear(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        scale_inv: torch.Tensor,
        block: tuple[int, int],
        bias: torch.Tensor | None = None,
        mode: Fp8Mode = "dequant",
    ) -> torch.Tensor:
        """``x [..., K] @ dequant(weight [N, K])^T (+ bias)`` with ``weight`` FP8 and one
        ``scale_inv`` per ``block``; ``mode`` as in ``kernels/fp8.py``."""

    @abstractmethod
    def sparse_attention(
        self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sink: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """DeepSeek-V4 attention: ``q [T, H, D]`` over the rows of ``kv [N, D]`` each query row's
        ``indices [T, K]`` name (``-1``: none; K = V), with a per-head ``sink [H]`` logit in the
        softmax -> ``[T, H, D]`` (``kernels/v4_attention.py``)."""

    @abstractmethod
    def indexer_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        starts: torch.Tensor,
        counts: torch.Tensor,
        max_count: int,
        k: int,
        scale: float,
    ) -> torch.Tensor:
        """CSA's indexer: each row's top ``k`` of its visible entries ``keys[starts[t] :
        starts[t] + counts[t]]`` by ``sum_h weights[t, h] ReLU(q[t, h] . key) * scale``, exact
        ties to the lowest index, ascending -> ``[T, k]`` int32 (``-1`` past a row's picks).
        ``max_count``: the largest of ``counts``, known on the host (no device read)."""

    @abstractmethod
    def compress_windows(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        ape: torch.Tensor,
        norm: torch.Tensor,
        eps: float,
        overlap: bool,
        prev_kv: torch.Tensor | None,
        prev_gate: torch.Tensor | None,
    ) -> torch.Tensor:
        """A V4 compressor's complete windows ``kv, gate [W, r, width]`` -> entries ``[W, dim]``
        float32 (``kernels/v4_attention.compress_windows_torch``)."""
