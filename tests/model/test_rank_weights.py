"""The torch-free count of a rank's weights equals what its model allocates, byte for byte."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tandem.cli.main import main
from tandem.model.config import ModelConfig
from tandem.model.deepseek import DeepseekV3
from tandem.model.dtypes import DTYPES
from tandem.model.expert_dispatch import LocalExperts
from tandem.model.rank_weights import DTYPE_BYTES, expert_slice, rank_weight_bytes

DEEPSEEK_V3 = Path(__file__).resolve().parents[2] / "deploy" / "models" / "deepseek-v3"


def meta_model_bytes(cfg: ModelConfig, dtype: str, rank: int, world: int, mtp: bool) -> int:
    """``weight_bytes()`` of the model a rank builds (``cluster/rank_setup.py``), on the meta device."""
    experts = expert_slice(cfg.n_routed_experts, rank, world)
    model = DeepseekV3(cfg, DTYPES[dtype], "meta", experts=experts, dispatcher=LocalExperts(), mtp=mtp)
    return model.weight_bytes()


@pytest.fixture(scope="module")
def tiny_configs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, ModelConfig]:
    """The tiny model as ``tandem model make-tiny`` writes it: plain, FP8 (24 x 24 blocks, so
    edge blocks are partial), FP8 with its MTP layer."""
    root = tmp_path_factory.mktemp("rank-weights")
    variants = {"plain": [], "fp8": ["--fp8-block", "24"], "fp8-mtp": ["--fp8-block", "24", "--mtp"]}
    for name, flags in variants.items():
        assert main(["model", "make-tiny", str(root / name), *flags]) == 0
    return {name: ModelConfig.from_dir(root / name) for name in variants}


@pytest.mark.parametrize("variant", ["plain", "fp8", "fp8-mtp"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("world,rank", [(1, 0), (3, 0), (3, 2), (32, 0), (32, 31)])
def test_tiny_count_equals_the_meta_model(
    tiny_configs: dict[str, ModelConfig], variant: str, dtype: str, world: int, rank: int
) -> None:
    cfg = tiny_configs[variant]
    assert (cfg.quant_block_size is not None) == variant.startswith("fp8")
    for mtp in (False, True) if cfg.num_nextn_predict_layers else (False,):
        counted = rank_weight_bytes(cfg, dtype, rank, world, mtp=mtp)
        assert counted.total_bytes == meta_model_bytes(cfg, dtype, rank, world, mtp)
    if len(expert_slice(cfg.n_routed_experts, rank, world)) == 0:  # rank 31 of 32: attention only
        assert counted.routed_expert_bytes == 0


def test_deepseek_v3_config_parses() -> None:
    cfg = ModelConfig.from_dir(DEEPSEEK_V3)
    assert (cfg.hidden_size, cfg.num_hidden_layers, cfg.n_routed_experts, cfg.vocab_size) == (
        7168, 61, 256, 129280,
    )  # fmt: skip
    assert cfg.quant_block_size == (128, 128) and cfg.num_nextn_predict_layers == 1
    assert cfg.rope.rope_type == "yarn" and cfg.rope.factor == 40.0
    assert cfg.max_position_embeddings == 163840 and cfg.kv_cache_dim == 576


@pytest.mark.parametrize("world", [16, 8, 2])
@pytest.mark.parametrize("mtp", [False, True])
def test_deepseek_v3_count_equals_the_meta_model(world: int, mtp: bool) -> None:
    cfg = ModelConfig.from_dir(DEEPSEEK_V3)
    for rank in (0, world - 1):
        counted = rank_weight_bytes(cfg, "bfloat16", rank, world, mtp=mtp)
        assert counted.total_bytes == meta_model_bytes(cfg, "bfloat16", rank, world, mtp)


def test_deepseek_v3_experts_divide_by_the_group() -> None:
    """256 experts split evenly at DEP 16, 8 and 2: the routed bytes halve as the group doubles,
    and the replicated bytes do not change."""
    cfg = ModelConfig.from_dir(DEEPSEEK_V3)
    counts = {n: rank_weight_bytes(cfg, "bfloat16", 0, n) for n in (2, 8, 16)}
    assert counts[2].routed_expert_bytes == 8 * counts[16].routed_expert_bytes
    assert counts[8].routed_expert_bytes == 2 * counts[16].routed_expert_bytes
    assert len({c.replicated_bytes for c in counts.values()}) == 1


def test_dtype_sizes_match_torch() -> None:
    assert {name: torch.empty((), dtype=d).element_size() for name, d in DTYPES.items()} == DTYPE_BYTES


def test_mtp_needs_the_layer_in_the_config(tiny_configs: dict[str, ModelConfig]) -> None:
    with pytest.raises(ValueError, match="multi-token-prediction"):
        rank_weight_bytes(tiny_configs["plain"], "float32", 0, 1, mtp=True)
