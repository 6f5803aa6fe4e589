"""The memory plan of a DeepSeek-V4 model: each kind of KV state counted (the window and the
compressors' open windows per running request, the compressed entries, the indexer's keys and
the overlap per token), pages that hold a multiple of every compression rate, the weights as
``DeepseekV4`` allocates them and as the checkpoint ships them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tandem.cli.main import main
from tandem.cluster.memory_plan import GIB, plan_memory
from tandem.cluster.topology import SpeculativeSpec, Topology
from tandem.model.expert_dispatch import LocalExperts
from tandem.model.make_tiny import BOS_ID, EOS_ID, fp8_quantization_config
from tandem.model.rank_weights import expert_slice
from tandem.model.v4.config import V4Config
from tandem.model.v4.kv_layout import slot_bytes, transfer_slots, v4_kinds
from tandem.model.v4.model import DeepseekV4
from tandem.model.v4.rank_weights import v4_rank_weight_bytes
from tandem.model.v4.tiny import tiny_v4_config_dict
from tandem.wire.messages import Role

FLASH = Path(__file__).resolve().parents[2] / "deploy" / "models" / "deepseek-v4-flash"


@pytest.mark.parametrize(("world", "mtp", "fp8"), [(1, False, False), (3, False, False), (2, True, True)])
def test_weight_bytes_are_what_the_model_allocates(world: int, mtp: bool, fp8: bool) -> None:
    """Counted from the config alone, as the model allocates them: a DEP rank's slice, the MTP
    layer, FP8 weights with their float32 block scales."""
    quant = {"quantization_config": fp8_quantization_config((16, 16))} if fp8 else {}
    cfg = V4Config.from_dict(tiny_v4_config_dict(BOS_ID, EOS_ID, **quant))
    for rank in range(world):
        experts = expert_slice(cfg.n_routed_experts, rank, world)
        # a slice needs a dispatcher to run; only its allocation is counted here
        model = DeepseekV4(cfg, torch.bfloat16, "meta", experts=experts, dispatcher=LocalExperts(), mtp=mtp)
        held = sum(p.numel() * p.element_size() for p in model.parameters())
        counted = v4_rank_weight_bytes(cfg, "bfloat16", rank, world, quantized=fp8, mtp=mtp)
        assert counted.total_bytes == held


def test_v4_flash_has_its_published_size_and_its_weights_fit_dep2_with_fp4_experts() -> None:
    """Its weights fit a DEP2 rank of an H200; its pages, keeping the window KV and overlap of an
    quarter of the pages for prefix-cache hits as the engine does, leave room for 2,670,720
    tokens there: more than the one 1M-token context the plan requires (the entries and indexer
    keys are 6,880 B a token, the window 44,032 B and the overlap 3,360 B on the pages that keep
    them)."""
    cfg = V4Config.from_dir(FLASH)
    assert cfg.layer_types.count("compressed_sparse_attention") == 21 and cfg.compress_rate(3) == 128
    params = v4_rank_weight_bytes(cfg, "bfloat16", 0, 1).total_bytes / 2  # every weight in bfloat16
    assert 284e9 < params < 285.5e9
    dep2 = v4_rank_weight_bytes(cfg, "bfloat16", 0, 2, quantized=True).total_bytes / GIB
    assert 75 < dep2 < 80  # "about 80 GB a rank at DEP2"
    plan = plan_memory(Topology.preset("dep16-dep2"), cfg, "bfloat16", gpu_memory_gib=141)
    decode = next(r for r in plan.ranks if r.role is Role.DECODE)
    assert decode.page_size == 128  # the preset's 64-token pages, made a multiple of 128
    kinds = {k.kind: k for k in decode.kinds}
    assert kinds["compressed"].per_token == 21 * 512 * 2 / 4 + 20 * 512 * 2 / 128
    assert kinds["indexer_keys"].per_token == 21 * 128 * 2 / 4
    assert kinds["overlap"].per_token == 21 * 2 * 4 * (512 + 128) * 4 / 128 / 4
    assert kinds["window"].per_request == 43 * 2 * 128 * 512 * 2  # the last 128 tokens span two pages
    assert kinds["page_window"].per_token == 43 * 512 * 2 / 4
    # open windows: (rate - 1) tokens' KV and gate projections (the indexer's too on CSA), float32;
    # on CSA the last complete window's Ca as well
    csa = 21 * (3 * 2 * (2 * 512 + 2 * 128) + 4 * 2 * (512 + 128)) * 4
    assert kinds["open_window"].per_request == csa + 20 * 127 * 2 * 512 * 4
    # the running requests' windows and open windows, and a state slot each for their transfers
    # (the window's last 127 tokens, the open windows and overlaps: 16.28 MiB)
    padding = slot_bytes(cfg, 2) - 43 * 127 * 512 * 2 - kinds["open_window"].per_request
    assert 0 <= padding < 16 * 10 * 43  # at most 10 fields a layer, each starting on 16 bytes
    running = 64 * (kinds["window"].per_request + kinds["open_window"].per_request)
    assert decode.state_bytes == running + 64 * slot_bytes(cfg, 2)
    assert decode.kv_page_bytes == pytest.approx(128 * sum(k.per_token for k in decode.kinds), abs=1)
    left = plan.usable_bytes - decode.weight_bytes - decode.workspace_bytes - decode.state_bytes
    assert decode.kv_pages == left // decode.kv_page_bytes
    assert decode.kv_pages == 20865 and plan.fits  # a 1M-token context needs 8,192 pages


def test_a_page_size_that_is_no_multiple_of_the_rates_is_refused_by_the_layout() -> None:
    cfg = V4Config.from_dir(FLASH)
    with pytest.raises(ValueError, match=r"page_size 64 is not a multiple of the compression rates \[128\]"):
        v4_kinds(cfg, 2, 64)


def test_mtp_drafts_add_the_mtp_layers_weights_window_and_slot_layer() -> None:
    """With MTP drafts a rank holds the MTP layer's weights, each request's MTP window, and
    each transfer slot one layer more; V4-Flash on dep16-dep2 still fits 141 GiB GPUs."""
    cfg = V4Config.from_dir(FLASH)
    plain = plan_memory(Topology.preset("dep16-dep2"), cfg, "bfloat16", gpu_memory_gib=141)
    topology = Topology.preset("dep16-dep2").model_copy(
        update={"speculative": SpeculativeSpec(drafter="mtp", tokens=1)}
    )
    mtp = plan_memory(topology, cfg, "bfloat16", gpu_memory_gib=141)
    assert mtp.fits
    window = (cfg.sliding_window - 1) * cfg.head_dim * 2
    slot_layer = slot_bytes(cfg, 2, True) - slot_bytes(cfg, 2)
    assert window <= slot_layer < window + 16
    for role, pool in ((Role.PREFILL, topology.prefill), (Role.DECODE, topology.decode)):
        assert pool is not None
        a, b = (next(r for r in p.ranks if r.role is role and r.rank == 0) for p in (plain, mtp))
        weights = v4_rank_weight_bytes(cfg, "bfloat16", 0, pool.dep, quantized=True, mtp=True).total_bytes
        assert b.weight_bytes == weights > a.weight_bytes
        slots = transfer_slots(role is Role.PREFILL, pool.max_num_seqs)
        assert b.state_bytes - a.state_bytes == pool.max_num_seqs * window + slots * slot_layer


def test_the_command_prints_each_kind_per_token_and_per_rank(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "memory", "--model", str(FLASH), "--preset", "dep16-dep2", "--gpu-memory-gib", "141"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "decode KV state, 128-token pages" in out
    assert (
        "compressed     41 layers  5,536.0 B a token" in out
        and "window         43 layers  10.75 MiB a request" in out
        and "page_window    43 layers  11,008.0 B a token" in out
    )
    assert "fits: yes" in out
    assert main([*args, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    decode = next(r for r in plan["ranks"] if r["role"] == "decode")
    assert {k["kind"] for k in decode["kinds"]} == {
        "window",
        "compressed",
        "indexer_keys",
        "overlap",
        "open_window",
        "page_window",
    }
    assert decode["page_size"] == 128 and plan["fits"]
