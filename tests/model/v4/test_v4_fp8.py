"""An FP8 DeepSeek-V4 checkpoint (DeepSeek's release format: the attention's projections, the
indexer's query projection and the experts FP8 with 128x128-style block scales under
``<module>.scale``; the compressors, the indexer's head weights and the router as they are)
stays FP8 on Tandem's model, and gives the tokens transformers gives on the same checkpoint
dequantised; DeepSeek's power-of-two scales (``F8_E8M0``) and transformers' spelling
(``weight_scale_inv``) load alike; a missing scale or a weight in the wrong format is named."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.model.checkpoint import CheckpointError
from tandem.model.kernels.fp8 import FP8_DTYPE, dequantize_fp8_block, quantize_fp8_block
from tandem.model.loader import load_model
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.model.v4.checkpoint import check_v4_model_dir
from tandem.model.v4.model import DeepseekV4
from tests.hf_v4_reference import hf_greedy, hf_v4, tandem_greedy, tandem_logits

BLOCK = (16, 16)
PROMPTS = [[random.Random(n).randrange(256) for _ in range(n)] for n in (5, 17, 64)]


def _scales(tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """FP8 weight name -> its scale tensor's name (either spelling)."""
    out = {}
    for name in tensors:
        for suffix in (".scale", ".weight_scale_inv"):
            if name.endswith(suffix):
                out[name.removesuffix(suffix) + ".weight"] = name
    return out


def _dequantised_copy(src: Path, dst: Path) -> None:
    """The checkpoint with every FP8 weight dequantised to float32 and no quantization_config."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    scales = _scales(tensors)
    out = {}
    for name, tensor in tensors.items():
        if name in scales.values():
            continue
        out[name] = (
            dequantize_fp8_block(tensor, tensors[scales[name]].float(), BLOCK) if name in scales else tensor
        )
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((dst / "config.json").read_text())
    del config["quantization_config"]
    (dst / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(
        tmp_path_factory.mktemp("fp8") / "model", seed=3, fp8_block=BLOCK, arch="deepseek_v4"
    )


def _fp8_parameters(model: DeepseekV4) -> set[str]:
    return {name for name, p in model.named_parameters() if p.dtype == FP8_DTYPE}


def test_an_fp8_v4_stays_fp8_and_gives_the_dequantised_checkpoints_tokens(
    fp8_dir: Path, tmp_path: Path
) -> None:
    model = load_model(fp8_dir, torch.float32, "cpu")
    fp8 = _fp8_parameters(model)
    for name in ("attn.wq_a", "attn.wq_b", "attn.wkv", "attn.wo_a", "attn.wo_b", "attn.indexer.wq_b"):
        assert f"layers.0.{name}" in fp8, name
    for name in ("ffn.w_gate_up", "ffn.w_down", "ffn.w1", "ffn.w2", "ffn.w3"):
        assert f"layers.1.{name}" in fp8, name
    assert "layers.0.attn.compressor.wkv" not in fp8 and "embed" not in fp8 and "head" not in fp8
    _dequantised_copy(fp8_dir, tmp_path / "float")
    dense = load_model(tmp_path / "float", torch.float32, "cpu")
    assert not _fp8_parameters(dense)
    assert model.weight_bytes() < 0.5 * dense.weight_bytes()
    hf = hf_v4(tmp_path / "float")
    for prompt in PROMPTS:
        assert tandem_greedy(model, prompt, 16) == hf_greedy(hf, prompt, 16), len(prompt)


def test_transformers_loads_the_fp8_checkpoint_itself_to_the_same_logits(fp8_dir: Path) -> None:
    """The checkpoint is in the published layout: transformers' own FP8 loader (``.scale`` names,
    dequantised on load) reads it, and its logits equal those of Tandem's FP8-resident model."""
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    quant = FineGrainedFP8Config(dequantize=True, weight_block_size=BLOCK)
    hf = DeepseekV4ForCausalLM.from_pretrained(fp8_dir, quantization_config=quant, dtype=torch.float32).eval()
    model = load_model(fp8_dir, torch.float32, "cpu")
    ids = PROMPTS[2]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    assert (tandem_logits(model, ids, len(ids)) - want).abs().max() < 1e-4


def _power_of_two_checkpoint(src: Path, dst: Path) -> None:
    """The checkpoint requantised with power-of-two scales stored as ``F8_E8M0`` under
    transformers' ``weight_scale_inv`` names."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    scales = _scales(tensors)
    out = {}
    for name, tensor in tensors.items():
        if name in scales.values():
            continue
        if name not in scales:
            out[name] = tensor
            continue
        weight = dequantize_fp8_block(tensor, tensors[scales[name]].float(), BLOCK)
        _, scale = quantize_fp8_block(weight, BLOCK)
        scale = torch.exp2(torch.ceil(torch.log2(scale)))  # DeepSeek-V4's UE8M0 scales
        full = scale.repeat_interleave(BLOCK[0], 0).repeat_interleave(BLOCK[1], 1)[
            : weight.shape[0], : weight.shape[1]
        ]
        out[name] = (weight / full).to(FP8_DTYPE)
        out[name.removesuffix(".weight") + ".weight_scale_inv"] = scale.to(torch.float8_e8m0fnu)
    save_file(out, str(dst / "model.safetensors"))


def test_power_of_two_scales_under_transformers_names_load_alike(fp8_dir: Path, tmp_path: Path) -> None:
    _power_of_two_checkpoint(fp8_dir, tmp_path / "e8m0")
    assert load_file(tmp_path / "e8m0" / "model.safetensors")[
        "layers.0.attn.wq_a.weight_scale_inv"
    ].dtype == (torch.float8_e8m0fnu)
    model = load_model(tmp_path / "e8m0", torch.float32, "cpu")
    _dequantised_copy(tmp_path / "e8m0", tmp_path / "float")
    hf = hf_v4(tmp_path / "float")
    for prompt in PROMPTS[1:]:
        assert tandem_greedy(model, prompt, 12) == hf_greedy(hf, prompt, 12), len(prompt)


def test_a_missing_scale_and_a_weight_not_in_fp8_are_named(fp8_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(fp8_dir, tmp_path / "bad")
    tensors = load_file(fp8_dir / "model.safetensors")
    del tensors["layers.0.attn.wq_a.scale"]
    tensors["layers.1.attn.wkv.weight"] = tensors["layers.1.attn.wkv.weight"].float()
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(CheckpointError) as caught:
        check_v4_model_dir(tmp_path / "bad")
    message = str(caught.value)
    assert "missing tensor 'layers.0.attn.wq_a.scale'" in message
    assert "tensor 'layers.1.attn.wkv.weight' has dtype F32, expected F8_E4M3" in message


def test_a_config_that_says_fp4_over_fp8_experts_is_refused_by_name(fp8_dir: Path, tmp_path: Path) -> None:
    shutil.copytree(fp8_dir, tmp_path / "fp4")
    config = json.loads((tmp_path / "fp4" / "config.json").read_text())
    config["quantization_config"]["expert_dtype"] = "fp4"
    (tmp_path / "fp4" / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        CheckpointError, match=r"'layers.0.ffn.experts.0.w1.weight' has dtype F8_E4M3, expected I8"
    ):
        load_model(tmp_path / "fp4", torch.float32, "cpu")
