"""The ``noaux_tc`` routing kernel against ``grouped_topk_torch`` (Triton's interpreter on CPU).

The kernel returns each token's experts best first; ``torch.topk(sorted=False)`` in any order,
so rows are compared as (expert, weight) pairs sorted by expert id. A row whose reference has a
near-tie at a selection boundary may legitimately pick the other expert or group (sigmoid differs
in the last bit between torch, the interpreter and a GPU); such rows are counted and must be rare.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import triton
import triton.backends.nvidia
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction

from tandem.model.kernels.moe import grouped_topk_torch
from tandem.model.kernels.moe_route_triton import (
    RoutingShapeError,
    _grouped_topk_kernel,
    grouped_topk_triton,
    launch_grouped_topk,
    tokens_per_program,
)

NEAR_TIE = 1e-5
REPO_ROOT = Path(__file__).resolve().parents[3]
CUOBJDUMP = Path(triton.backends.nvidia.__file__).parent / "bin" / "cuobjdump"


@dataclass(frozen=True)
class Routing:
    num_experts: int
    n_group: int
    topk_group: int
    top_k: int


TINY = Routing(16, 4, 2, 4)
TINY_SMALL = Routing(8, 2, 1, 3)
DEEPSEEK_V3 = Routing(256, 8, 4, 8)
DEEPSEEK_V2 = Routing(160, 8, 3, 6)  # experts not a power of two: padded columns


def _inputs(num_tokens: int, cfg: Routing, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    logits = 2 * torch.randn(num_tokens, cfg.num_experts, generator=gen)
    bias = 0.3 * torch.randn(cfg.num_experts, generator=gen)  # large enough to change choices
    return logits, bias


def _near_tie(logits: torch.Tensor, bias: torch.Tensor, cfg: Routing) -> bool:
    """Whether one token's routing sits within NEAR_TIE of a group or expert boundary."""
    biased = logits.double().sigmoid() + bias.double()
    groups = biased.view(cfg.n_group, -1).topk(2, dim=-1)[0].sum(-1)
    ranked_groups = groups.sort(descending=True)[0]
    if (
        cfg.topk_group < cfg.n_group
        and ranked_groups[cfg.topk_group - 1] - ranked_groups[cfg.topk_group] < NEAR_TIE
    ):
        return True
    kept = groups.topk(cfg.topk_group)[1]
    allowed = biased.view(cfg.n_group, -1)[kept].flatten().sort(descending=True)[0]
    return bool(cfg.top_k < allowed.numel() and allowed[cfg.top_k - 1] - allowed[cfg.top_k] < NEAR_TIE)


def _check(
    weights: torch.Tensor,
    ids: torch.Tensor,
    logits: torch.Tensor,
    bias: torch.Tensor,
    cfg: Routing,
    norm_topk_prob: bool,
    scale: float,
) -> None:
    ref_weights, ref_ids = grouped_topk_torch(
        logits, bias, cfg.top_k, cfg.n_group, cfg.topk_group, norm_topk_prob, scale
    )
    num_tokens = logits.shape[0]
    assert weights.shape == ids.shape == (num_tokens, cfg.top_k)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert not torch.isnan(weights).any()
    assert ((ids >= 0) & (ids < cfg.num_experts)).all()
    sorted_ids, order = ids.sort(dim=1)
    ref_sorted_ids, ref_order = ref_ids.sort(dim=1)
    assert (sorted_ids[:, 1:] != sorted_ids[:, :-1]).all(), "an expert chosen twice for one token"
    same = (sorted_ids == ref_sorted_ids).all(dim=1)
    for t in torch.nonzero(~same).flatten().tolist():
        assert _near_tie(logits[t], bias, cfg), f"token {t}: {sorted_ids[t]} vs {ref_sorted_ids[t]}"
    assert (~same).sum() <= max(1, num_tokens // 100)
    torch.testing.assert_close(
        weights.gather(1, order)[same], ref_weights.gather(1, ref_order)[same], rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    "cfg,num_tokens",
    [(TINY, 1), (TINY, 37), (TINY_SMALL, 1), (TINY_SMALL, 37), (DEEPSEEK_V3, 1), (DEEPSEEK_V3, 67)],
)
@pytest.mark.parametrize("norm_topk_prob,scale", [(True, 2.5), (False, 1.0)])
def test_matches_reference(cfg: Routing, num_tokens: int, norm_topk_prob: bool, scale: float) -> None:
    logits, bias = _inputs(num_tokens, cfg, seed=num_tokens + cfg.num_experts)
    weights, ids = grouped_topk_triton(
        logits, bias, cfg.top_k, cfg.n_group, cfg.topk_group, norm_topk_prob, scale
    )
    _check(weights, ids, logits, bias, cfg, norm_topk_prob, scale)


def test_writes_every_element() -> None:
    cfg = DEEPSEEK_V3
    logits, bias = _inputs(19, cfg, seed=5)
    weights = torch.full((19, cfg.top_k), float("nan"))
    ids = torch.full((19, cfg.top_k), -1, dtype=torch.int64)
    launch_grouped_topk(logits, bias, cfg.top_k, cfg.n_group, cfg.topk_group, True, 2.5, weights, ids)
    _check(weights, ids, logits, bias, cfg, True, 2.5)


def test_row_strided_logits() -> None:
    cfg = TINY
    logits, bias = _inputs(9, Routing(24, 4, 2, 4), seed=7)
    view = logits[:, 3 : 3 + cfg.num_experts]
    weights, ids = grouped_topk_triton(view, bias[:16], cfg.top_k, cfg.n_group, cfg.topk_group, True, 2.5)
    _check(weights, ids, view, bias[:16], cfg, True, 2.5)


def test_bias_changes_the_choice_but_not_the_weights() -> None:
    """Weights are the unbiased scores: a bias that forces one expert in gives it its own score."""
    cfg = TINY
    logits, bias = _inputs(5, cfg, seed=11)
    bias = bias.clone()
    bias[13] = 10.0
    weights, ids = grouped_topk_triton(logits, bias, cfg.top_k, cfg.n_group, cfg.topk_group, False, 1.0)
    assert (ids == 13).sum(dim=1).eq(1).all()
    torch.testing.assert_close(weights[ids == 13], logits[:, 13].sigmoid(), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "cfg", [Routing(16, 3, 2, 4), Routing(16, 4, 5, 4), Routing(16, 4, 1, 5), Routing(16, 4, 2, 0)]
)
def test_rejects_impossible_settings(cfg: Routing) -> None:
    logits, bias = _inputs(2, Routing(16, 4, 2, 4), seed=1)
    with pytest.raises(RoutingShapeError):
        grouped_topk_triton(logits, bias, cfg.top_k, cfg.n_group, cfg.topk_group, True, 1.0)


@pytest.mark.kernels_full
@pytest.mark.parametrize("cfg", [TINY, TINY_SMALL, DEEPSEEK_V3, DEEPSEEK_V2])
@pytest.mark.parametrize("num_tokens", [2, 63, 64, 65, 1000])
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_full_grid(cfg: Routing, num_tokens: int, norm_topk_prob: bool) -> None:
    logits, bias = _inputs(num_tokens, cfg, seed=3 * num_tokens + cfg.top_k)
    weights, ids = grouped_topk_triton(
        logits, bias, cfg.top_k, cfg.n_group, cfg.topk_group, norm_topk_prob, 2.5
    )
    _check(weights, ids, logits, bias, cfg, norm_topk_prob, 2.5)


def sm90_spill_bytes(cfg: Routing, num_tokens: int) -> int:
    """Compile the kernel for an H200 (sm_90) with no GPU present, as a launch for ``num_tokens``
    would specialise it, and return the stack bytes ptxas gave it: register spills."""
    kernel = _grouped_topk_kernel
    fn = kernel if isinstance(kernel, JITFunction) else JITFunction(kernel.fn)
    consts = {
        "EXPERTS_PER_GROUP": cfg.num_experts // cfg.n_group,
        "N_GROUP": cfg.n_group,
        "TOPK_GROUP": cfg.topk_group,
        "TOP_K": cfg.top_k,
        "NORM_TOPK_PROB": True,
        "BLOCK_T": tokens_per_program(num_tokens, cfg.num_experts),
        "BLOCK_E": triton.next_power_of_2(cfg.num_experts),
        "BLOCK_G": triton.next_power_of_2(cfg.n_group),
        "BLOCK_K": triton.next_power_of_2(cfg.top_k),
    }
    sig = dict.fromkeys(["logits_ptr", "bias_ptr", "weights_ptr"], "*fp32") | {"ids_ptr": "*i64"}
    sig |= dict.fromkeys(["num_tokens", "num_experts", "logits_stride"], "i32")
    sig |= {"routed_scaling_factor": "fp32"} | dict.fromkeys(consts, "constexpr")
    aligned = ["logits_ptr", "bias_ptr", "weights_ptr", "ids_ptr", "num_experts", "logits_stride"]
    attrs = {(fn.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    compiled = triton.compile(
        ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32), options={"num_warps": 4}
    )
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        usage = subprocess.run(
            [str(CUOBJDUMP), "--dump-resource-usage", str(cubin)], capture_output=True, text=True, check=True
        ).stdout
    return int(usage.split("STACK:")[1].split()[0])


def test_compiles_for_h200_without_spills() -> None:
    """Compiled in a child process without ``TRITON_INTERPRET``: once the interpreter is chosen it
    also takes over Triton's own library functions, which a compilation calls."""
    if not CUOBJDUMP.exists():
        pytest.skip("Triton's NVIDIA tools are not installed")
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    code = (
        "import json; from tests.model.kernels.test_moe_route import DEEPSEEK_V3, TINY, sm90_spill_bytes; "
        "print(json.dumps([sm90_spill_bytes(cfg, n) for cfg, n in ((DEEPSEEK_V3, 1), (DEEPSEEK_V3, 4096), "
        "(TINY, 4096))]))"
    )
    child = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=600
    )
    assert child.returncode == 0, child.stderr[-3000:]
    assert json.loads(child.stdout.splitlines()[-1]) == [0, 0, 0]
