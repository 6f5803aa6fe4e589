"""Manifold-constrained hyper-connections (mHC): the residual is ``hc_mult`` streams per token
``[T, N, D]``. Before a block, a learned projection of the normed streams gives ``pre`` (how
the streams collapse into the block's input), ``post`` (how the block's output spreads back)
and ``comb`` (how the streams mix into the new residual), ``comb`` made doubly stochastic by
Sinkhorn-Knopp. After the last layer the hyper-head collapses the streams once more. Every
figure is computed in float32, as the model's own code does."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class HyperConnection(nn.Module):
    """``fn [(2 + N) * N, N * D]``, ``base [(2 + N) * N]``, ``scale [3]`` (float32)."""

    def __init__(
        self,
        hc_mult: int,
        hidden: int,
        iters: int,
        hc_eps: float,
        norm_eps: float,
        device: torch.device | str,
    ) -> None:
        super().__init__()
        n = hc_mult
        self.hc_mult, self.iters, self.hc_eps, self.norm_eps = n, iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden, device=device), requires_grad=False)
        self.base = nn.Parameter(torch.empty((2 + n) * n, device=device), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, device=device), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``streams [T, N, D]`` -> ``post [T, N]``, ``comb [T, N, N]`` (float32) and the block's
        input ``[T, D]`` in the streams' dtype."""
        n = self.hc_mult
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        mixes = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb = torch.softmax(comb_w.view(-1, n, n) * comb_s + comb_b.view(n, n), dim=-1) + self.hc_eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
        return post, comb, collapsed


def spread(post: torch.Tensor, comb: torch.Tensor, out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The new streams: the block's output ``out [T, D]`` spread by ``post`` plus the old streams
    mixed by ``comb`` (``comb^T @ streams``)."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * out.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), streams
    )


class HyperHead(nn.Module):
    """The last collapse, before the final norm: ``fn [N, N * D]``, ``base [N]``, ``scale [1]``."""

    def __init__(
        self, hc_mult: int, hidden: int, hc_eps: float, norm_eps: float, device: torch.device | str
    ) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden, device=device), requires_grad=False)
        self.base = nn.Parameter(torch.empty(hc_mult, device=device), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(1, device=device), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(streams.flatten(1).float(), self.norm_eps)
        pre = (
            torch.sigmoid(F.linear(flat, self.fn.float()) * self.scale.float() + self.base.float())
            + self.hc_eps
        )
        return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)
