"""CSA's lightning indexer: for each query, the top ``index_topk`` compressed entries it may
attend to, by ``score(t, s) = sum_h w_{t,h} * ReLU(q_{t,h} . k_s)`` over ``index_n_heads`` heads
(``w`` from the token's hidden state, ``k`` the indexer's own compressed keys, both scaled as
the model's code scales them). Entries whose window is not complete at the query's position
are never chosen.

Ties go to the lowest entry index. Entries whose every head is clipped by the ReLU score exactly
0.0, so ties are common (on small models most valid scores may be 0); a top-k that breaks them
by the shape of the score matrix (``torch.topk`` on a whole prompt, a chunk and one decode row
each pick differently) makes a request's tokens depend on how it was split into steps. A stable
descending sort keeps the lowest index among equal scores whatever the split."""

from __future__ import annotations

import torch
from torch import nn

from tandem.model.v4.compressor import Compressor, CompressorState
from tandem.model.v4.rope import rotate_tail


def top_entries(scores: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
    """``scores [n, E]`` and ``visible [n, E]`` -> ``[n, min(k, E)]`` entry indices, the highest
    scores first and the lowest index among equal ones; ``-1`` where fewer than ``k`` entries
    are visible."""
    masked = scores.masked_fill(~visible, float("-inf"))
    order = torch.sort(masked, dim=-1, descending=True, stable=True).indices[:, : min(k, scores.shape[-1])]
    return torch.where(visible.gather(1, order), order, torch.full_like(order, -1))


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
    ) -> None:
        super().__init__()
        self.heads, self.head_dim, self.rate, self.topk = heads, head_dim, rate, topk
        self.wq_b = nn.Parameter(
            torch.empty(heads * head_dim, q_lora_rank, dtype=dtype, device=device), requires_grad=False
        )
        self.weights_proj = nn.Parameter(torch.empty(heads, hidden, device=device), requires_grad=False)
        self.compressor = Compressor(hidden, head_dim, rate, True, eps, device)

    def forward(
        self,
        state: CompressorState,
        x: torch.Tensor,
        q_residual: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> torch.Tensor:
        """A request's next tokens ``x [n, D]`` (their query residual ``[n, q_lora_rank]``, their
        ``positions [n]``) -> the entries each may attend to, ``[n, <= topk]`` (``-1``: none)."""
        keys = self.compressor(state, x, cos, sin, q_residual.dtype)
        n = x.shape[0]
        q = (q_residual @ self.wq_b.t()).view(n, self.heads, self.head_dim)
        q = rotate_tail(q, cos[positions], sin[positions])
        scores = torch.relu(q.float() @ keys.float().t()) * self.head_dim**-0.5  # [n, H, E]
        weights = (x.float() @ self.weights_proj.t()) * self.heads**-0.5  # [n, H]
        total = (scores * weights.unsqueeze(-1)).sum(dim=1)  # [n, E]
        visible = (
            torch.arange(keys.shape[0], device=x.device)[None, :] < ((positions + 1) // self.rate)[:, None]
        )
        return top_entries(total, visible, self.topk)
