"""``V4Config`` reads a V4 ``config.json`` in transformers' spelling and in the older one
(per-layer ``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``, a flat YaRN
``rope_scaling``) to the same config, with transformers' rope tables; a field it cannot run
is named."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tandem.model.config import ModelConfigError
from tandem.model.make_tiny import BOS_ID, EOS_ID
from tandem.model.v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, V4Config
from tandem.model.v4.rope import rope_table
from tandem.model.v4.tiny import tiny_v4_config_dict


def _raw(**overrides: Any) -> dict[str, Any]:
    return tiny_v4_config_dict(BOS_ID, EOS_ID, **overrides)


def test_transformers_config_reads_back_to_the_same_fields() -> None:
    from transformers import DeepseekV4Config

    raw = _raw()
    ours = V4Config.from_dict(raw)
    theirs = V4Config.from_dict(DeepseekV4Config(**raw).to_dict())
    assert ours == theirs
    assert ours.layer_types == (CSA, HCA, SLIDING, CSA) and ours.mlp_layer_types == (HASH_MOE, MOE, MOE, MOE)
    assert (ours.compress_rate(0), ours.compress_rate(1), ours.compress_rate(2)) == (4, 16, 0)
    assert ours.qk_rope_head_dim == 8 and ours.compress_rates == (4, 16)
    assert ours.rope_main.rope_type == "default" and ours.rope_main.theta == 10000.0
    assert ours.rope_compress.rope_type == "yarn" and ours.rope_compress.theta == 160000.0
    assert ours.rope_compress.attention_factor == 1.0


def test_the_older_spelling_reads_to_the_same_config() -> None:
    raw = _raw()
    for key in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor"):
        raw.pop(key)
    raw |= {"compress_ratios": [4, 128, 0, 4], "num_hash_layers": 1, "qk_rope_head_dim": 8}
    raw["rope_scaling"] = raw.pop("rope_parameters")
    cfg = V4Config.from_dict(raw)
    assert cfg.layer_types == (CSA, HCA, SLIDING, CSA) and cfg.mlp_layer_types == (HASH_MOE, MOE, MOE, MOE)
    assert cfg.compress_rate(1) == 128 and cfg.qk_rope_head_dim == 8
    assert cfg.rope_compress == V4Config.from_dict(_raw()).rope_compress


def test_rope_tables_are_transformers_own() -> None:
    from transformers import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    raw = _raw()
    cfg = V4Config.from_dict(raw)
    hf = DeepseekV4RotaryEmbedding(DeepseekV4Config(**raw))
    positions = torch.arange(0, 2048, 7)[None]
    for name, rope in (("main", cfg.rope_main), ("compress", cfg.rope_compress)):
        cos, sin = hf(torch.zeros(1), positions, layer_type=name)
        ours_cos, ours_sin = rope_table(rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
        assert torch.allclose(ours_cos[positions[0]], cos[0], atol=1e-6), name
        assert torch.allclose(ours_sin[positions[0]], sin[0], atol=1e-6), name


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"num_key_value_heads": 2}, "num_key_value_heads 2"),
        ({"layer_types": [CSA, HCA]}, "layer_types has 2 entries for 4 layers"),
        ({"layer_types": [CSA, HCA, SLIDING, "full_attention"]}, r"layer_types: \['full_attention'\]"),
        ({"mlp_layer_types": ["dense", MOE, MOE, MOE]}, r"mlp_layer_types: \['dense'\]"),
        ({"scoring_func": "relu"}, "scoring_func 'relu'"),
        ({"o_groups": 3}, "o_groups 3"),
        ({"n_shared_experts": 2}, "n_shared_experts 2"),
        ({"sliding_window": None}, "missing required field 'sliding_window'"),
        ({"rope_parameters": {"rope_type": "longrope"}}, "rope type 'longrope'"),
        ({"quantization_config": {"quant_method": "awq"}}, "quantization_config"),
    ],
)
def test_a_field_tandem_cannot_run_is_named(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ModelConfigError, match=message):
        V4Config.from_dict(_raw(**overrides))
