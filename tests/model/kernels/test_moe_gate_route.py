"""The fused router GEMM + ``noaux_tc`` routing kernel against the two steps it replaces (the
``torch`` backend's ``moe_gate_route``: a float32 GEMM of the widened activations, then
``grouped_topk_torch``), in Triton's interpreter on CPU.

Rows are compared as in ``test_moe_route``: ids sorted per row must be equal, except on a row
whose reference sits within ``NEAR_TIE`` of a selection boundary (the kernel sums the hidden
size in another order, so a logit may differ in its last bits); such rows must be rare. Weights
of the equal rows agree to float32 rounding.
"""

from __future__ import annotations

import pytest
import torch

from tandem.model.kernels import moe_gate_route_triton as fused_module
from tandem.model.kernels.moe import grouped_topk_torch
from tandem.model.kernels.moe_gate_route_triton import (
    BLOCK_K,
    BLOCK_T,
    NUM_STAGES,
    NUM_WARPS,
    gate_route_triton,
)
from tandem.model.kernels.moe_route_triton import RoutingShapeError
from tandem.model.kernels.registry import get_backend
from tests.model.kernels.test_mla_decode import NanTorch, sm90_resources
from tests.model.kernels.test_moe_route import DEEPSEEK_V3, TINY, TINY_SMALL, Routing, _check

HIDDEN = 72  # not a multiple of the K tile
assert HIDDEN % BLOCK_K


@pytest.fixture(autouse=True)
def _poison_buffers(monkeypatch: pytest.MonkeyPatch) -> None:
    """The outputs start as NaN, so a row the kernel fails to write fails the check."""
    monkeypatch.setattr(fused_module, "torch", NanTorch())


def _inputs(
    num_tokens: int, cfg: Routing, hidden: int, dtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Activations in ``dtype``, a float32 router weight scaled so logits spread about +-2, and a
    correction bias large enough to change choices."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=gen).to(dtype)
    gate_weight = 2 * hidden**-0.5 * torch.randn(cfg.num_experts, hidden, generator=gen)
    bias = 0.3 * torch.randn(cfg.num_experts, generator=gen)
    return x, gate_weight, bias


def _check_fused(
    x: torch.Tensor,
    gate_weight: torch.Tensor,
    bias: torch.Tensor,
    cfg: Routing,
    norm_topk_prob: bool = True,
    scale: float = 2.5,
) -> None:
    route = (cfg.top_k, cfg.n_group, cfg.topk_group, norm_topk_prob, scale)
    weights, ids = gate_route_triton(x, gate_weight, bias, *route)
    logits = torch.nn.functional.linear(x.to(torch.float32), gate_weight)  # the reference's logits
    _check(weights, ids, logits, bias, cfg, norm_topk_prob, scale)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 5, 37])
def test_matches_two_steps(dtype: torch.dtype, num_tokens: int) -> None:
    """DeepSeek-like grouping on 16 experts; 37 tokens is not a multiple of BLOCK_T."""
    assert 37 % BLOCK_T
    x, gate_weight, bias = _inputs(num_tokens, TINY, HIDDEN, dtype, seed=num_tokens)
    _check_fused(x, gate_weight, bias, TINY)


@pytest.mark.parametrize("norm_topk_prob,scale", [(True, 2.5), (False, 1.0)])
@pytest.mark.parametrize("cfg", [TINY_SMALL, DEEPSEEK_V3])
def test_other_routings(cfg: Routing, norm_topk_prob: bool, scale: float) -> None:
    """8 experts (padded to tl.dot's 16 columns) and DeepSeek-V3's 256 in 8 groups."""
    x, gate_weight, bias = _inputs(19, cfg, HIDDEN, torch.bfloat16, seed=cfg.num_experts)
    _check_fused(x, gate_weight, bias, cfg, norm_topk_prob, scale)


def test_row_strided_activations() -> None:
    """``x`` as a view into wider rows, as a slice of a larger buffer would be."""
    wide, gate_weight, bias = _inputs(21, TINY, HIDDEN + 8, torch.bfloat16, seed=3)
    x = wide[:, 3 : 3 + HIDDEN]
    _check_fused(x, gate_weight[:, :HIDDEN].contiguous(), bias, TINY)


def test_default_is_the_two_steps() -> None:
    """The seam's default (the ``torch`` backend's) is the float32 GEMM, then ``moe_route``."""
    x, gate_weight, bias = _inputs(9, TINY, HIDDEN, torch.bfloat16, seed=6)
    route = (TINY.top_k, TINY.n_group, TINY.topk_group, True, 2.5)
    weights, ids = get_backend("cpu", "torch").moe_gate_route(x, gate_weight, bias, *route)
    ref_weights, ref_ids = grouped_topk_torch(x.float() @ gate_weight.T, bias, *route)
    assert torch.equal(ids, ref_ids) and torch.equal(weights, ref_weights)


def test_the_triton_backend_fuses_from_its_gpu_kinds_batch_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Below the tuning table's batch the two steps run (a decode batch's GEMM spreads over every
    SM), from it the fused kernel; both give the reference's routing."""
    from tandem.model.kernels import triton_backend
    from tandem.model.kernels.tuning import fused_gate_route_min_tokens

    assert fused_gate_route_min_tokens("H200") == 1024 and fused_gate_route_min_tokens("default") == 0
    monkeypatch.setattr(triton_backend, "fused_gate_route_min_tokens", lambda: 16)
    fused_calls: list[int] = []

    def counted(x: torch.Tensor, *args: object) -> tuple[torch.Tensor, torch.Tensor]:
        fused_calls.append(x.shape[0])
        return gate_route_triton(x, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(triton_backend, "gate_route_triton", counted)
    backend = get_backend("cpu", "triton")
    route = (TINY.top_k, TINY.n_group, TINY.topk_group, True, 2.5)
    for num_tokens in (5, 37):
        x, gate_weight, bias = _inputs(num_tokens, TINY, HIDDEN, torch.float32, seed=num_tokens)
        weights, ids = backend.moe_gate_route(x, gate_weight, bias, *route)
        _check(weights, ids, x @ gate_weight.T, bias, TINY, True, 2.5)
    assert fused_calls == [37]


def test_empty_batch() -> None:
    x, gate_weight, bias = _inputs(0, TINY, HIDDEN, torch.bfloat16, seed=4)
    weights, ids = gate_route_triton(
        x, gate_weight, bias, TINY.top_k, TINY.n_group, TINY.topk_group, True, 2.5
    )
    assert weights.shape == ids.shape == (0, TINY.top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64


def test_rejects_impossible_settings() -> None:
    x, gate_weight, bias = _inputs(2, TINY, HIDDEN, torch.float32, seed=5)
    with pytest.raises(RoutingShapeError):
        gate_route_triton(x, gate_weight, bias, 4, 3, 2, True, 1.0)


def test_compiles_for_h200_without_spills() -> None:
    """DeepSeek-V3 shapes: hidden 7168, 256 experts in 8 groups, 4 groups kept, top 8, bf16
    activations, with the launch's tiles. ``routed_scaling_factor`` is passed as a constant (the
    harness types scalars as i32); it changes no registers."""
    ((stack, shared),) = sm90_resources(
        [
            {
                "module": "tandem.model.kernels.moe_gate_route_triton",
                "kernel": "_gate_route_kernel",
                "constexprs": {
                    "EXPERTS_PER_GROUP": 32,
                    "N_GROUP": 8,
                    "TOPK_GROUP": 4,
                    "TOP_K": 8,
                    "NORM_TOPK_PROB": True,
                    "BLOCK_T": BLOCK_T,
                    "BLOCK_E": 256,
                    "BLOCK_G": 8,
                    "BLOCK_TOPK": 8,
                    "BLOCK_D": BLOCK_K,
                    "routed_scaling_factor": 2.5,
                },
                "pointers": {"x": "*bf16", "w": "*fp32", "bias": "*fp32", "weights": "*fp32", "ids": "*i64"},
                "num_warps": NUM_WARPS,
                "num_stages": NUM_STAGES,
            }
        ]
    )
    assert stack == 0
    assert shared <= 227 * 1024
