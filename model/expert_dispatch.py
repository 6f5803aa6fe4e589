"""Where a MoE layer's routed experts run.

The model routes each token locally (the router is replicated); an :class:`ExpertDispatcher`
then produces the weighted sum of the chosen experts' outputs. :class:`LocalExperts` runs them in
this process (every expert is here); an expert-parallel dispatcher moves rows to the ranks that
own their experts and back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.model.kernels.backend import KernelBackend
from tandem.model.kernels.moe import ExpertScales


class ExpertWeights(Protocol):
    """What a dispatcher reads of a MoE layer (``layers.MoE``): the routed experts this rank
    holds, ``first_expert`` onwards, with their stacked gate/up and down projections."""

    @property
    def w_gate_up(self) -> torch.Tensor: ...

    @property
    def w_down(self) -> torch.Tensor: ...

    @property
    def first_expert(self) -> int: ...

    @property
    def expert_scales(self) -> ExpertScales | None:
        """The experts' FP8 block scales; None when they are in the activation dtype."""

    @property
    def swiglu_limit(self) -> float | None:
        """Where the experts' gate and up are clipped (DeepSeek-V4); None: not clipped."""


@dataclass(frozen=True)
class Routed:
    """A MoE layer's tokens ``x [T, D]`` and where its router sends them: ``ids [T, k]`` (experts)
    with ``weights [T, k]`` (float32)."""

    x: torch.Tensor
    weights: torch.Tensor
    ids: torch.Tensor


def run_experts(moe: ExpertWeights, routed: Routed, ops: KernelBackend) -> torch.Tensor:
    """The experts this process holds over ``routed`` (every id among them)."""
    x, weights, ids = routed.x, routed.weights, routed.ids
    return ops.moe_experts(
        x, weights, ids, moe.w_gate_up, moe.w_down, moe.first_expert, moe.expert_scales, moe.swiglu_limit
    )


class ExpertDispatcher(ABC):
    @property
    def syncs_host(self) -> bool:
        """Whether a MoE layer reads values back to the host (then a step that must not wait
        for the device cannot run through it as it is)."""
        return False

    @abstractmethod
    def routed_experts(self, moe: ExpertWeights, routed: Routed, ops: KernelBackend) -> torch.Tensor:
        """``sum_k weights[t, k] * expert_{ids[t, k]}(x[t])`` for every token ``t`` of ``routed``."""


class LocalExperts(ExpertDispatcher):
    def routed_experts(self, moe: ExpertWeights, routed: Routed, ops: KernelBackend) -> torch.Tensor:
        return run_experts(moe, routed, ops)
