from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

import tandem.model.checkpoint as checkpoint
from tandem.model.checkpoint import (
    CheckpointError,
    dequantize_fp8_block,
    load_checkpoint,
    quantize_fp8_block,
)
from tandem.model.config import ModelConfig, ModelConfigError, expected_tensor_shapes
from tandem.model.make_tiny import (
    TinyCheckpointError,
    make_tiny_checkpoint,
    tiny_config_dict,
    tiny_weights,
    write_checkpoint,
)

FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
PREFIX = "model.layers.1.mlp."


@pytest.fixture(scope="module")
def tiny_cfg(tiny_dir: Path) -> ModelConfig:
    return ModelConfig.from_dir(tiny_dir)


@pytest.fixture(scope="module")
def tiny_tensors(tiny_cfg: ModelConfig) -> dict[str, torch.Tensor]:
    return tiny_weights(tiny_cfg, seed=0)


def per_expert_state(hf_model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """HF's state dict with its fused expert tensors split into the per-expert checkpoint layout."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in hf_model.state_dict().items():
        if name.endswith("mlp.experts.gate_up_proj"):  # [E, 2I, H]: gate rows, then up rows
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                state[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = tensor[e, :inter]
                state[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = tensor[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):  # [E, H, I]
            for e in range(tensor.shape[0]):
                state[name.replace("down_proj", f"{e}.down_proj.weight")] = tensor[e]
        else:
            state[name] = tensor
    return state


def assert_same_tensors(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor), name


def write(tmp_path: Path, tensors: dict[str, torch.Tensor], **overrides: Any) -> Path:
    return write_checkpoint(tmp_path / "ckpt", tiny_config_dict(**overrides), tensors)


def load_error(model_dir: Path) -> str:
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(model_dir, ModelConfig.from_dir(model_dir), torch.float32)
    return str(info.value)


def test_tiny_checkpoint_round_trips(tiny_dir: Path, tiny_cfg: ModelConfig) -> None:
    names = {p.name for p in tiny_dir.iterdir()}
    assert names == {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"}
    tensors = load_checkpoint(tiny_dir, tiny_cfg, torch.bfloat16)
    shapes = expected_tensor_shapes(tiny_cfg)
    assert {name: tuple(t.shape) for name, t in tensors.items()} == shapes
    router = {n for n in tensors if n.endswith((".mlp.gate.weight", ".mlp.gate.e_score_correction_bias"))}
    assert router and all(tensors[n].dtype == torch.float32 for n in router)
    assert all(t.dtype == torch.bfloat16 for n, t in tensors.items() if n not in router)
    norm = tensors["model.layers.0.input_layernorm.weight"].float()
    assert norm.min() > 0.8 and norm.max() < 1.2 and norm.std() > 0
    bias = tensors[PREFIX + "gate.e_score_correction_bias"].float()
    assert 0 < bias.abs().max() < 0.1


def test_tiny_checkpoint_is_reproducible(tiny_dir: Path, tmp_path: Path) -> None:
    same = make_tiny_checkpoint(tmp_path / "same", seed=0)
    other = make_tiny_checkpoint(tmp_path / "other", seed=1)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (same / name).read_bytes() == (tiny_dir / name).read_bytes(), name
    assert (other / "model.safetensors").read_bytes() != (tiny_dir / "model.safetensors").read_bytes()


def test_tiny_checkpoint_refuses_foreign_directory(tmp_path: Path) -> None:
    out = make_tiny_checkpoint(tmp_path / "m", seed=0)
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert make_tiny_checkpoint(out, seed=0) == out  # identical: nothing rewritten
    assert (out / "model.safetensors").stat().st_mtime_ns == before
    with pytest.raises(TinyCheckpointError, match="seed 1"):
        make_tiny_checkpoint(out, seed=1)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(TinyCheckpointError, match="not empty"):
        make_tiny_checkpoint(foreign)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "m"]  # no staging left


def test_tiny_checkpoint_loads_in_transformers(tiny_dir: Path, tiny_cfg: ModelConfig) -> None:
    hf_model, info = DeepseekV3ForCausalLM.from_pretrained(tiny_dir, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_same_tensors(load_checkpoint(tiny_dir, tiny_cfg, torch.float32), per_expert_state(hf_model))


@pytest.mark.parametrize("q_lora_rank", [32, None])
def test_transformers_checkpoint_loads(tmp_path: Path, q_lora_rank: int | None) -> None:
    raw = tiny_config_dict(q_lora_rank=q_lora_rank)
    hf_config = DeepseekV3Config(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})
    torch.manual_seed(0)
    hf_model = DeepseekV3ForCausalLM(hf_config)
    hf_model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        saved = set(f.keys())
    assert PREFIX + "experts.0.gate_proj.weight" in saved  # save_pretrained writes per-expert names
    assert PREFIX + "experts.gate_up_proj" not in saved
    tensors = load_checkpoint(tmp_path, ModelConfig.from_dir(tmp_path), torch.float32)
    assert_same_tensors(tensors, per_expert_state(hf_model))


def test_sharded_checkpoint_loads_identically(
    tmp_path: Path, tiny_cfg: ModelConfig, tiny_tensors: dict[str, torch.Tensor]
) -> None:
    total = sum(t.numel() * t.element_size() for t in tiny_tensors.values())
    out = write_checkpoint(tmp_path, tiny_config_dict(), tiny_tensors, shard_max_bytes=total // 4)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == total
    assert len(set(index["weight_map"].values())) >= 3
    assert_same_tensors(load_checkpoint(out, tiny_cfg, torch.float32), tiny_tensors)

    (out / "model.safetensors.index.json").unlink()  # no index: every *.safetensors is read
    assert_same_tensors(load_checkpoint(out, tiny_cfg, torch.float32), tiny_tensors)


def test_missing_shard_names_index_and_file(tmp_path: Path, tiny_tensors: dict[str, torch.Tensor]) -> None:
    out = write_checkpoint(tmp_path, tiny_config_dict(), tiny_tensors, shard_max_bytes=400_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shard = index["weight_map"][PREFIX + "experts.0.up_proj.weight"]
    (out / shard).unlink()
    message = load_error(out)
    assert "model.safetensors.index.json" in message and shard in message


def fp8_error_bound(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """Largest sound |dequantised - original| per element.

    Quantisation rounds ``x = w / scale`` to the nearest e4m3 value. With 3 mantissa bits the
    spacing of normal numbers (|x| >= 2^-6) is at most 2^-3 |x|, so rounding is off by at most
    half of it, 2^-4 |x|; below 2^-6 the subnormal spacing is 2^-9, an error of at most 2^-10.
    Scaled back: 2^-4 |w| + 2^-10 scale, plus slack for the fp32 divide and multiply.
    """
    scale = dequantize_fp8_block(torch.ones(weight.shape, dtype=torch.float8_e4m3fn), scale_inv)
    return 2**-4 * weight.abs() + 2**-10 * scale + 1e-6 * weight.abs()


def test_fp8_block_round_trip_with_partial_blocks() -> None:
    weight = torch.randn(200, 300, generator=torch.Generator().manual_seed(0)) * 0.05
    weight[:128, :128] = 0  # an all-zero block must not divide by zero
    fp8, scale_inv = quantize_fp8_block(weight, (128, 128))
    assert fp8.dtype == torch.float8_e4m3fn and tuple(scale_inv.shape) == (2, 3)
    restored = dequantize_fp8_block(fp8, scale_inv, (128, 128))
    assert torch.all((restored - weight).abs() <= fp8_error_bound(weight, scale_inv))
    assert torch.all(restored[:128, :128] == 0)
    assert (restored - weight).abs().max() > 0  # it really went through FP8


def quantize_like_deepseek(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every 2-D linear weight to FP8; embeddings, lm_head, norms and the router gate stay as they are."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        keep = tensor.dim() != 2 or name.endswith(
            ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight")
        )
        if keep:
            out[name] = tensor
        else:
            out[name], out[name + "_scale_inv"] = quantize_fp8_block(tensor, (128, 128))
    return out


def test_fp8_checkpoint_is_dequantised(tmp_path: Path, tiny_tensors: dict[str, torch.Tensor]) -> None:
    quantized = quantize_like_deepseek(tiny_tensors)
    out = write(tmp_path, quantized, quantization_config=FP8_CONFIG)
    cfg = ModelConfig.from_dir(out)
    assert cfg.quant_block_size == (128, 128)
    loaded = load_checkpoint(out, cfg, torch.float32)
    assert sorted(loaded) == sorted(tiny_tensors)
    scaled = [name for name in tiny_tensors if name + "_scale_inv" in quantized]
    assert (
        PREFIX + "experts.3.down_proj.weight" in scaled and "model.layers.0.self_attn.o_proj.weight" in scaled
    )
    for name, want in tiny_tensors.items():
        if name in scaled:
            bound = fp8_error_bound(want, quantized[name + "_scale_inv"])
            assert torch.all((loaded[name] - want).abs() <= bound), name
        else:
            assert torch.equal(loaded[name], want), name


def test_fp8_without_scale_is_rejected(tmp_path: Path, tiny_tensors: dict[str, torch.Tensor]) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors = dict(tiny_tensors, **{name: quantize_fp8_block(tiny_tensors[name])[0]})
    message = load_error(write(tmp_path, tensors, quantization_config=FP8_CONFIG))
    assert name in message and "FP8" in message


def test_fp8_scale_of_wrong_shape_is_rejected(tmp_path: Path, tiny_tensors: dict[str, torch.Tensor]) -> None:
    name = "model.layers.0.self_attn.o_proj.weight"
    fp8, _ = quantize_fp8_block(tiny_tensors[name])
    tensors = dict(tiny_tensors, **{name: fp8, name + "_scale_inv": torch.ones(2, 2)})
    message = load_error(write(tmp_path, tensors, quantization_config=FP8_CONFIG))
    assert name + "_scale_inv" in message and "[2, 2]" in message and "[1, 1]" in message


def test_missing_tensor_is_named(tmp_path: Path, tiny_tensors: dict[str, torch.Tensor]) -> None:
    name = PREFIX + "experts.5.up_proj.weight"
    message = load_error(write(tmp_path, {k: v for k, v in tiny_tensors.items() if k != name}))
    assert f"missing tensor {name!r}" in message and "[32, 64]" in message


def test_extra_tensor_is_named(tmp_path: Path, tiny_tensors: dict[str, torch.Tensor]) -> None:
    message = load_error(write(tmp_path, dict(tiny_tensors, **{"model.extra.weight": torch.ones(3, 5)})))
    assert "unexpected tensor 'model.extra.weight'" in message and "[3, 5]" in message


def test_wrong_shape_names_both_shapes(tmp_path: Path, tiny_tensors: dict[str, torch.Tensor]) -> None:
    name = "model.layers.2.self_attn.kv_b_proj.weight"
    message = load_error(write(tmp_path, dict(tiny_tensors, **{name: torch.ones(128, 31)})))
    assert name in message and "[128, 31]" in message and "[128, 32]" in message


def test_mtp_layer_and_rotary_buffers_are_ignored(
    tmp_path: Path, tiny_cfg: ModelConfig, tiny_tensors: dict[str, torch.Tensor]
) -> None:
    extra = {
        "model.layers.3.eh_proj.weight": torch.ones(64, 128),  # the multi-token-prediction layer
        "model.layers.3.mlp.experts.0.gate_proj.weight": torch.ones(32, 64),
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4),
    }
    tensors = load_checkpoint(write(tmp_path, dict(tiny_tensors, **extra)), tiny_cfg, torch.float32)
    assert_same_tensors(tensors, tiny_tensors)


def test_expert_filter_reads_only_selected_experts(
    tiny_dir: Path, tiny_cfg: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    read: list[str] = []

    class RecordingOpen:
        def __init__(self, path: str, framework: str) -> None:
            self._file = safe_open(path, framework=framework)

        def __enter__(self) -> RecordingOpen:
            return self

        def __exit__(self, *exc: object) -> None:
            return None

        def keys(self) -> list[str]:
            return list(self._file.keys())

        def get_slice(self, name: str) -> Any:
            return self._file.get_slice(name)

        def get_tensor(self, name: str) -> torch.Tensor:
            read.append(name)
            return self._file.get_tensor(name)

    monkeypatch.setattr(checkpoint, "safe_open", RecordingOpen)
    mine = {(1, 0), (1, 7), (2, 15)}
    tensors = load_checkpoint(
        tiny_dir, tiny_cfg, torch.float32, expert_filter=lambda layer, expert: (layer, expert) in mine
    )
    routed = {n for n in expected_tensor_shapes(tiny_cfg) if ".mlp.experts." in n}
    kept = {n for n in routed if any(f"layers.{layer}.mlp.experts.{e}." in n for layer, e in mine)}
    assert len(kept) == 9
    assert set(tensors) == set(expected_tensor_shapes(tiny_cfg)) - routed | kept
    assert set(read) == set(tensors)
    assert PREFIX + "shared_experts.gate_proj.weight" in tensors


def test_config_errors(tmp_path: Path, tiny_tensors: dict[str, torch.Tensor]) -> None:
    with pytest.raises(ModelConfigError, match=r"config\.json not found"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match=r"cannot read config\.json"):
        ModelConfig.from_dir(tmp_path)
    llama = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64}
    (tmp_path / "config.json").write_text(json.dumps(llama))
    with pytest.raises(ModelConfigError, match="llama"):
        ModelConfig.from_dir(tmp_path)


def test_missing_directory_and_files(tmp_path: Path, tiny_cfg: ModelConfig) -> None:
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "absent", tiny_cfg, torch.float32)
    with pytest.raises(CheckpointError, match=r"no model\.safetensors"):
        load_checkpoint(tmp_path, tiny_cfg, torch.float32)
    (tmp_path / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(CheckpointError, match="cannot read safetensors file"):
        load_checkpoint(tmp_path, tiny_cfg, torch.float32)


def test_an_fp8_mtp_layer_is_dequantised_like_the_rest(tmp_path: Path) -> None:
    """DeepSeek-V3's release quantizes the MTP layer's linear weights too (``eh_proj``, its
    attention and experts): loaded with ``mtp``, each is its block-scaled dequantisation."""
    cfg = ModelConfig.from_dict(tiny_config_dict(num_nextn_predict_layers=1))
    tensors = tiny_weights(cfg, seed=2)
    quantized = quantize_like_deepseek(tensors)
    out = write(tmp_path, quantized, quantization_config=FP8_CONFIG, num_nextn_predict_layers=1)
    loaded = load_checkpoint(out, ModelConfig.from_dir(out), torch.float32, mtp=True)
    assert sorted(loaded) == sorted(tensors)
    mtp = f"model.layers.{cfg.num_hidden_layers}."
    for name in (
        mtp + "eh_proj.weight",
        mtp + "self_attn.kv_b_proj.weight",
        mtp + "mlp.experts.5.up_proj.weight",
    ):
        assert name + "_scale_inv" in quantized
        bound = fp8_error_bound(tensors[name], quantized[name + "_scale_inv"])
        assert torch.all((loaded[name] - tensors[name]).abs() <= bound), name
