from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.model.config import ModelConfig, ModelConfigError
from tandem.model.kernels.rope import rope_inv_freq
from tests.hf_reference import TINY, VARIANTS


def _raw(**overrides: object) -> dict[str, object]:
    return {"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], **TINY, **overrides}


def test_hub_rope_scaling_and_transformers_rope_parameters_agree() -> None:
    yarn = dict(VARIANTS["yarn"]["rope_parameters"])  # type: ignore[call-overload]
    theta = yarn.pop("rope_theta")
    yarn.pop("rope_type")
    hub = ModelConfig.from_dict(_raw(rope_scaling={"type": "yarn", **yarn}, rope_theta=theta))
    v5 = ModelConfig.from_dict(_raw(rope_parameters=VARIANTS["yarn"]["rope_parameters"]))
    assert hub.rope == v5.rope
    assert hub.rope.rope_type == "yarn" and hub.rope.factor == 8.0
    assert hub.softmax_scale == v5.softmax_scale != hub.qk_head_dim**-0.5


def test_yarn_matches_transformers() -> None:
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_cfg = DeepseekV3Config(**{**TINY, **VARIANTS["yarn"]})
    ref_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    ours = ModelConfig.from_dict(_raw(**VARIANTS["yarn"]))
    freq, factor = rope_inv_freq(ours.rope, ours.qk_rope_head_dim)
    assert torch.equal(freq, ref_freq)
    assert factor == pytest.approx(ref_factor)


def test_yarn_factor_defaults_to_the_length_ratio() -> None:
    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "original_max_position_embeddings": 128}
    cfg = ModelConfig.from_dict(_raw(rope_parameters=rope, max_position_embeddings=512))
    assert cfg.rope.factor == 4.0


@pytest.mark.parametrize(
    "raw,needle",
    [
        (_raw(model_type="llama", architectures=["LlamaForCausalLM"]), "architecture"),
        (_raw(kv_lora_rank=None), "kv_lora_rank"),
        (_raw(n_group=3), "n_group"),
        (_raw(rope_parameters={"rope_type": "linear", "factor": 2.0}), "linear"),
        (_raw(num_key_value_heads=2), "num_key_value_heads"),
    ],
)
def test_bad_configs_are_named(raw: dict[str, object], needle: str) -> None:
    with pytest.raises(ModelConfigError, match=needle):
        ModelConfig.from_dict(raw)


def test_missing_and_unreadable_config(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="does not exist"):
        ModelConfig.from_dir(tmp_path / "nope")
    with pytest.raises(ModelConfigError, match=r"config\.json not found"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ModelConfigError, match="cannot read"):
        ModelConfig.from_dir(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(_raw()))
    assert ModelConfig.from_dir(tmp_path).kv_cache_dim == 40
