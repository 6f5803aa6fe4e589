"""An FP8 checkpoint kept FP8 in memory: its resident bytes, and its tokens against
``transformers`` running the dequantised checkpoint."""

from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.model.checkpoint import iter_checkpoint, load_checkpoint
from tandem.model.config import ModelConfig
from tandem.model.deepseek import DeepseekV3
from tandem.model.kernels.fp8 import FP8_DTYPE
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.wire.request_params import SamplingParams
from tests.hf_reference import dequantised_hf_model, greedy_hf_tokens

BLOCK = (32, 32)
GEN_TOKENS = 24


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("fp8") / "model", seed=5, fp8_block=BLOCK)


@pytest.fixture(scope="module")
def hf_dequantised(fp8_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Any:
    return dequantised_hf_model(fp8_dir, tmp_path_factory.mktemp("dequantised") / "model")


def _fp8_model(path: Path, dtype: torch.dtype, keep_fp8: bool = True) -> DeepseekV3:
    cfg = ModelConfig.from_dir(path)
    model = DeepseekV3(cfg, dtype, keep_fp8=keep_fp8)
    model.load_weights(iter_checkpoint(path, cfg, dtype, keep_fp8=model.keeps_fp8))
    return model


def test_fp8_weights_stay_fp8_at_about_one_byte_each(fp8_dir: Path) -> None:
    kept = _fp8_model(fp8_dir, torch.float32)
    dequantised = _fp8_model(fp8_dir, torch.float32, keep_fp8=False)
    fp8 = {n: p for n, p in kept.named_parameters() if p.dtype == FP8_DTYPE}
    layer = "layers.1."
    assert {f"{layer}mlp.w_gate_up", f"{layer}mlp.w_down", f"{layer}self_attn.o_proj.weight"} <= set(fp8)
    assert f"{layer}self_attn.kv_b_proj.weight" not in fp8  # the absorbed decode weights
    assert kept.layers[1].self_attn.kv_b_proj.weight.dtype == torch.float32
    fp8_weights = sum(p.numel() for p in fp8.values())
    scales = sum(p.numel() for n, p in kept.named_parameters() if n.endswith(("_scale_inv", "_scale")))
    other = sum(p.numel() * 4 for n, p in kept.named_parameters() if p.dtype != FP8_DTYPE) - 4 * scales
    # 1 byte a weight plus 4 bytes a 32x32 block: the FP8 part is 1/4 of its float32 bytes
    assert kept.weight_bytes() == fp8_weights + 4 * scales + other
    assert 4 * scales <= fp8_weights / 200
    assert dequantised.weight_bytes() == 4 * fp8_weights + other


def test_both_activation_modes_agree_with_the_dequantised_model(fp8_dir: Path, monkeypatch: Any) -> None:
    from tandem.model.attention_metadata import AttentionMetadata
    from tandem.model.kv_pool import KVPool

    cfg = ModelConfig.from_dir(fp8_dir)
    reference = DeepseekV3(cfg, torch.float32, keep_fp8=False)
    reference.load_weights(load_checkpoint(fp8_dir, cfg, torch.float32))
    ids = torch.randint(2, cfg.vocab_size, (19,), generator=torch.Generator().manual_seed(1))

    def logits(model: DeepseekV3) -> torch.Tensor:
        pool = KVPool(cfg, 8, 8, torch.float32)
        meta = AttentionMetadata.build(8, [19], [19], [[0, 1, 2]])
        return model.compute_logits(model.forward(ids, torch.arange(19), meta, pool))

    want = logits(reference)
    got = {}
    for mode in ("dequant", "quant"):
        monkeypatch.setenv("TANDEM_FP8_ACTIVATIONS", mode)
        got[mode] = logits(_fp8_model(fp8_dir, torch.float32))
    assert float((got["dequant"] - want).abs().max() / want.abs().max()) < 1e-5
    # quantised activations really went through FP8. Each GEMM is exact against an emulation
    # (tests/model/kernels/test_fp8_gemm.py); through a whole model a rounding that flips with the
    # summation order compounds, so here only the distributions are compared
    assert not torch.allclose(got["quant"], want, rtol=1e-3, atol=1e-3)
    cosine = F.cosine_similarity(got["quant"], want, dim=-1)
    assert float(cosine.mean()) > 0.9, cosine


def test_fp8_greedy_tokens_match_transformers_on_the_dequantised_checkpoint(
    fp8_dir: Path, hf_dequantised: Any
) -> None:
    rng = random.Random(2)
    prompts = [[rng.randrange(2, 256) for _ in range(n)] for n in (1, 7, 16, 33)]
    expected = greedy_hf_tokens(hf_dequantised, prompts, GEN_TOKENS)
    engine = ColocatedEngine(_fp8_model(fp8_dir, torch.float64), EngineConfig(page_size=8, num_pages=64))
    outputs = engine.generate(prompts, SamplingParams(max_tokens=GEN_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in outputs] == expected
    from_dir = ColocatedEngine.from_model_dir(fp8_dir, torch.float64, EngineConfig(page_size=8, num_pages=64))
    assert from_dir.model.layers[1].mlp.w_down.dtype == FP8_DTYPE  # type: ignore[union-attr]
    again = from_dir.generate(prompts, SamplingParams(max_tokens=GEN_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in again] == expected


def test_a_float_tensor_for_an_fp8_layer_is_quantised_on_the_way_in(fp8_dir: Path) -> None:
    cfg = ModelConfig.from_dir(fp8_dir)
    model = DeepseekV3(cfg, torch.float32)
    dense = load_checkpoint(fp8_dir, cfg, torch.float32)
    model.load_weights(copy.copy(dense))
    name = "model.layers.1.self_attn.o_proj.weight"
    fp8 = dict(iter_checkpoint(fp8_dir, cfg, torch.float32, keep_fp8=lambda n: n == name))
    o_proj = model.layers[1].self_attn.o_proj
    assert torch.equal(o_proj.weight.float(), fp8[name].float())
    assert torch.equal(o_proj.weight_scale_inv, fp8[name + "_scale_inv"])
