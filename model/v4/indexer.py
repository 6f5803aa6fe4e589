"""CSA's lightning indexer: for each query, the top ``index_topk`` compressed entries it may
attend to, by ``score(t, s) = sum_h w_{t,h} * ReLU(q_{t,h} . k_s)`` over ``index_n_heads`` heads
(``w`` from the token's hidden state, ``k`` the indexer's own compressed keys, both scaled as
the model's code scales them). Entries whose window is not complete at the query's position
are never chosen.

Ties go to the lowest entry index. Entries whose every head is clipped by the ReLU score exactly
0.0, so ties are common (on small models most valid scores may be 0); a top-k that breaks them
by the shape of the score matrix (``torch.topk`` on a whole prompt, a chunk and one decode row
each pick differently) makes a request's tokens depend on how it was split into steps. A stable
descending sort keeps the lowest index among equal scores whatever the split. The kernel
backend's ``indexer_topk`` scores and selects (``kernels/v4_attention.py``, and a Triton top-k that
is stable by construction); this module holds the indexer's weights, its compressor and its
queries."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.model.v4.compressor import Compressor, CompressorState
from tandem.model.v4.projection import Projections, add_weight
from tandem.model.v4.rope import rotate_tail

if TYPE_CHECKING:
    from tandem.model.kernels.backend import KernelBackend


class Indexer(nn.Module):
    def __init__(
        self,
        hidden: int,
        q_lora_rank: int,
        heads: int,
        head_dim: int,
        rate: int,
        topk: int,
        eps: float,
        dtype: torch.dtype,
        device: torch.device | str,
        block: tuple[int, int] | None = None,
    ) -> None:
        super().__init__()
        self.heads, self.head_dim, self.rate, self.topk = heads, head_dim, rate, topk
        self.proj = Projections(block)
        add_weight(self, "wq_b", heads * head_dim, q_lora_rank, dtype, device, block)
        self.weights_proj = nn.Parameter(torch.empty(heads, hidden, device=device), requires_grad=False)
        self.compressor = Compressor(hidden, head_dim, rate, True, eps, device)

    def keys(
        self,
        state: CompressorState,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        dtype: torch.dtype,
        ops: KernelBackend,
    ) -> torch.Tensor:
        """A request's next tokens ``x [n, D]`` -> its indexer keys so far ``[E, head_dim]``."""
        return self.compressor(state, x, cos, sin, dtype, ops)

    def choose(
        self,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        starts: torch.Tensor,
        max_count: int,
        ops: KernelBackend,
    ) -> torch.Tensor:
        """The step's tokens ``x [T, D]`` (their query residual, ``positions [T]``), the step's
        indexer keys ``keys [N, head_dim]`` with each row's request's first at ``starts [T]`` ->
        the entries each row may attend to, ``[T, <= topk]`` (relative to its request's first;
        ascending; ``-1``: none). A row sees the entries whose window is complete;
        ``max_count``: the most any row sees (its request's entry count, on the host)."""
        t = x.shape[0]
        q = self.proj(self, "wq_b", q_residual, ops).view(t, self.heads, self.head_dim)
        q = rotate_tail(q, cos[positions], sin[positions])
        weights = (x.float() @ self.weights_proj.t()) * self.heads**-0.5  # [T, H]
        counts = (positions + 1) // self.rate
        k = min(self.topk, max_count)
        return ops.indexer_topk(q, weights, keys, starts, counts, max_count, k, self.head_dim**-0.5)
