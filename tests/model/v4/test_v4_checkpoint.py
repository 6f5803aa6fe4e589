"""A V4 checkpoint is checked from its headers before anything starts: every missing,
unexpected, misshapen or mistyped tensor named in one line; transformers' spellings of the same
tensors pass; the tensors then load one at a time into a model that gives the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.model.checkpoint import CheckpointError
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.model.v4.checkpoint import check_v4_model_dir, iter_v4_checkpoint
from tandem.model.v4.model import DeepseekV4


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("v4") / "model", seed=1, arch="deepseek_v4")


def _rewritten(tiny: Path, out: Path, tensors: dict[str, torch.Tensor]) -> Path:
    out.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (out / name).write_bytes((tiny / name).read_bytes())
    save_file(tensors, str(out / "model.safetensors"))
    return out


def test_every_problem_is_named_in_one_line(tiny: Path, tmp_path: Path) -> None:
    tensors = load_file(tiny / "model.safetensors")
    tensors.pop("layers.1.attn.compressor.ape")
    tensors["layers.0.attn.wq_x.weight"] = torch.zeros(2)
    tensors["layers.2.attn.wkv.weight"] = torch.zeros(32, 3)
    tensors["layers.0.ffn.gate.tid2eid"] = tensors["layers.0.ffn.gate.tid2eid"].float()
    bad = _rewritten(tiny, tmp_path / "bad", tensors)
    with pytest.raises(CheckpointError) as raised:
        check_v4_model_dir(bad)
    message = str(raised.value)
    assert message.startswith(f"{bad}: checkpoint does not match config.json: ") and "\n" not in message
    assert "missing tensor 'layers.1.attn.compressor.ape' (expected shape [16, 32])" in message
    assert "unexpected tensor 'layers.0.attn.wq_x.weight' with shape [2]" in message
    assert "tensor 'layers.2.attn.wkv.weight' has shape [32, 3], expected [32, 64]" in message
    assert "tensor 'layers.0.ffn.gate.tid2eid' has dtype F32, expected I64 or I32" in message


def test_transformers_spellings_pass_and_load_to_the_same_model(tiny: Path, tmp_path: Path) -> None:
    tensors = load_file(tiny / "model.safetensors")
    renamed = {("model." + k if k.startswith("layers.") else k): v for k, v in tensors.items()}
    renamed["model.embed_tokens.weight"] = renamed.pop("embed.weight")
    renamed["model.hc_head.hc_fn"] = renamed.pop("hc_head_fn")
    renamed["model.layers.0.attn.kv_norm.weight"] = renamed.pop("model.layers.0.attn.norm.weight")
    renamed["mtp.0.enorm.weight"] = torch.ones(64)  # the MTP layer's: skipped for now
    other = _rewritten(tiny, tmp_path / "hf", renamed)
    cfg = check_v4_model_dir(other)
    a, b = DeepseekV4(cfg), DeepseekV4(cfg)
    a.load_weights(iter_v4_checkpoint(tiny, cfg))
    b.load_weights(iter_v4_checkpoint(other, cfg))
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters(), strict=True):
        assert torch.equal(x, y), name


def test_a_model_holding_a_slice_of_the_experts_needs_an_expert_parallel_dispatcher(tiny: Path) -> None:
    """Without one the other ranks' experts' outputs would be missing: refused at construction."""
    cfg = check_v4_model_dir(tiny)
    with pytest.raises(ValueError, match="needs an expert-parallel dispatcher"):
        DeepseekV4(cfg, experts=range(0, 4))
    names = {name for name, _ in iter_v4_checkpoint(tiny, cfg, experts=range(0, 4))}
    experts = {int(n.split(".experts.")[1].split(".")[0]) for n in names if ".experts." in n}
    assert experts == set(range(4))
