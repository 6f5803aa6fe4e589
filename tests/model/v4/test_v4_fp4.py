"""FP4 routed experts (DeepSeek-V4's published format, written by ``tandem model fp4-experts``)
stay FP4 on the rank: the engine serves the tokens of the checkpoint's dequantised twin, its
experts' resident bytes are the FP4 size, transformers' own reader of the format gives the same
logits, and a bad conversion or tensor is refused by name."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.cli.main import main
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.model.checkpoint import CheckpointError
from tandem.model.kernels.registry import get_backend
from tandem.model.loader import load_model
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.model.v4.fp4_experts import Fp4ConversionError, write_fp4_experts
from tandem.model.v4.model import DeepseekV4
from tandem.model.v4.rank_weights import v4_rank_weight_bytes
from tandem.wire.request_params import SamplingParams
from tests.hf_v4_reference import tandem_logits

PROMPTS = [[(7 * n + 3 * i) % 250 + 3 for i in range(n)] for n in (5, 23, 70)]
EXPERT_PARAMS = ("ffn.w_gate_up", "ffn.w_down", "ffn.w_gate_up_scale", "ffn.w_down_scale")


@pytest.fixture(scope="module")
def converted(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp4")
    src = make_tiny_checkpoint(root / "src", seed=3, arch="deepseek_v4", num_nextn_predict_layers=1)
    write_fp4_experts(src, root / "fp4", root / "twin")
    return {"src": src, "fp4": root / "fp4", "twin": root / "twin"}


def _expert_bytes(model: DeepseekV4) -> int:
    return sum(p.nbytes for name, p in model.named_parameters() if name.endswith(EXPERT_PARAMS))


def _generate(model_dir: Path, kernels: str = "torch", requests: int = 5) -> list[list[int]]:
    """Greedy and seeded tokens of the prompts (the first ``requests`` of them), prefix caching on."""
    engine = ColocatedEngine.from_model_dir(model_dir, config=EngineConfig(enable_prefix_caching=True))
    engine.model.ops = get_backend("cpu", kernels)
    greedy = SamplingParams(max_tokens=8, ignore_eos=True)
    seeded = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0.8, seed=11)
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[0], PROMPTS[1], PROMPTS[2]][:requests]
    outputs = engine.generate(prompts, ([greedy, seeded] * 3)[:requests])
    return [o.token_ids for o in outputs]


def test_fp4_experts_stay_fp4_and_serve_the_twins_tokens(converted: dict[str, Path]) -> None:
    model = load_model(converted["fp4"], torch.float32, "cpu", mtp=True)
    experts = {name: p.dtype for name, p in model.named_parameters() if name.endswith(EXPERT_PARAMS)}
    assert experts and set(experts.values()) == {torch.uint8}, experts
    assert any(name.startswith("mtp.") for name in experts)  # the MTP layer's experts too
    assert model.mtp is not None
    cfg = model.cfg
    inter, h, layers = cfg.moe_intermediate_size, cfg.hidden_size, cfg.num_hidden_layers + 1
    fp4_size = layers * cfg.n_routed_experts * 3 * inter * h * (1 / 2 + 1 / 32)
    assert abs(_expert_bytes(model) - fp4_size) <= 0.05 * fp4_size
    # what the memory plan counts for them is what is resident
    planned = v4_rank_weight_bytes(cfg, "float32", 0, 1, quantized=True, mtp=True)
    assert _expert_bytes(model) == planned.routed_expert_bytes
    twin = load_model(converted["twin"], torch.float32, "cpu", mtp=True)
    assert _expert_bytes(twin) == round(fp4_size * 4 / (1 / 2 + 1 / 32))  # float32: 4 bytes a weight
    assert model.weight_bytes() < twin.weight_bytes() - 0.8 * _expert_bytes(twin)
    assert _generate(converted["fp4"]) == _generate(converted["twin"])


def test_the_triton_fp4_kernels_serve_the_same_tokens(converted: dict[str, Path]) -> None:
    """Triton's interpreter on CPU; float32 activations, so the sums differ from the torch
    kernels' by rounding only."""
    assert _generate(converted["fp4"], "triton", 2) == _generate(converted["fp4"], "torch", 2)


def test_transformers_reads_the_published_format_to_the_same_logits(tmp_path: Path) -> None:
    """The release's combination: FP8 attention and shared experts, FP4 routed experts. The
    FP4 checkpoint is read by transformers' own FP8/FP4 loader (its e2m1 table and nibble order,
    dequantised on load), whose logits equal those of Tandem's FP4-resident model."""
    from transformers import DeepseekV4ForCausalLM, FineGrainedFP8Config

    block = (16, 16)
    src = make_tiny_checkpoint(tmp_path / "fp8", seed=5, fp8_block=block, arch="deepseek_v4")
    write_fp4_experts(src, tmp_path / "fp4")
    tensors = load_file(tmp_path / "fp4" / "model.safetensors")
    assert tensors["layers.1.ffn.experts.0.w1.weight"].dtype == torch.int8
    assert tensors["layers.1.ffn.experts.0.w1.scale"].dtype == torch.float8_e8m0fnu
    assert tensors["layers.1.attn.wq_a.weight"].dtype == torch.float8_e4m3fn  # the rest as it was
    assert json.loads((tmp_path / "fp4" / "config.json").read_text())["expert_dtype"] == "fp4"
    quant = FineGrainedFP8Config(dequantize=True, weight_block_size=block, expert_dtype="fp4")
    hf = DeepseekV4ForCausalLM.from_pretrained(
        tmp_path / "fp4", quantization_config=quant, dtype=torch.float32
    )
    model = load_model(tmp_path / "fp4", torch.float32, "cpu")
    ids = PROMPTS[2]
    with torch.no_grad():
        want = hf.eval()(torch.tensor([ids])).logits[0]
    assert (tandem_logits(model, ids, len(ids)) - want).abs().max() < 1e-4
    with pytest.raises(Fp4ConversionError, match=r"--twin: .* is FP8"):
        write_fp4_experts(src, tmp_path / "again", tmp_path / "twin")
    assert not (tmp_path / "again").exists() and not (tmp_path / "twin").exists()


def test_a_conversion_or_a_tensor_in_the_wrong_format_is_refused_by_name(
    converted: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["model", "fp4-experts", str(converted["src"]), str(converted["fp4"])]) == 2
    assert f"DST: {converted['fp4']} exists" in capsys.readouterr().err
    with pytest.raises(Fp4ConversionError, match=r"SRC: .* FP4 already"):
        write_fp4_experts(converted["fp4"], tmp_path / "out")
    assert main(["model", "fp4-experts", str(converted["src"]), str(tmp_path / "cli")]) == 0
    assert (tmp_path / "cli" / "tokenizer.json").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left behind
    bad = tmp_path / "bad"
    shutil.copytree(converted["fp4"], bad)
    tensors = load_file(bad / "model.safetensors")
    tensors["layers.1.ffn.experts.0.w2.weight"] = torch.zeros(64, 32)  # unpacked floats
    del tensors["layers.2.ffn.experts.3.w1.scale"]
    save_file(tensors, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError) as caught:
        load_model(bad, torch.float32, "cpu")
    message = str(caught.value)
    assert "tensor 'layers.1.ffn.experts.0.w2.weight' has shape [64, 32], expected [64, 16]" in message
    assert "tensor 'layers.1.ffn.experts.0.w2.weight' has dtype F32, expected I8 or U8" in message
    assert "missing tensor 'layers.2.ffn.experts.3.w1.scale' (expected shape [32, 2])" in message
