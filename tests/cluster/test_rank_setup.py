"""A DEP group's rendezvous: rank 0's store keeps its port bound from the moment it is chosen,
so nothing else on the node can take it before the group joins. A rank's model: its slice of
the routed experts, an FP8 checkpoint's weights kept FP8."""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from safetensors import safe_open

from tandem.cluster.rank_setup import GroupRendezvous, load_rank_model
from tandem.model.deepseek import DeepseekV3
from tandem.model.kernels.fp8 import FP8_DTYPE
from tandem.model.layers import DecoderLayer, MoE
from tandem.model.make_tiny import make_tiny_checkpoint
from tests.listening import listeners


def test_rank0_store_holds_its_port_and_serves_the_other_ranks() -> None:
    rendezvous = GroupRendezvous()
    master = rendezvous.open(timeout_s=10)
    host, _, port = master.rpartition(":")
    assert rendezvous.open(timeout_s=10) == master  # opening twice keeps the one store

    with socket.socket() as s, pytest.raises(OSError):
        s.bind((host, int(port)))

    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    client.set("rank1", "ready")
    assert client.get("rank1") == b"ready"

    # it listens on the node's address alone (torch's own store would take every interface)
    (listener,) = [x for x in listeners({os.getpid()}) if x.port == int(port)]
    assert listener.address == host


def test_a_rank_loads_its_expert_slice_of_an_fp8_checkpoint_as_fp8(tmp_path: Path) -> None:
    """Rank 1 of a DEP2 group holds experts 8..15 of 16, as the checkpoint's FP8 bytes and
    block scales (not dequantised), and no other expert."""
    fp8_dir = make_tiny_checkpoint(tmp_path / "fp8", seed=5, fp8_block=(32, 32))
    cfg, model, dispatcher = load_rank_model(
        str(fp8_dir), "float64", torch.device("cpu"), rank=1, world_size=2
    )
    assert model.experts == dispatcher.local == range(8, 16)
    with safe_open(str(fp8_dir / "model.safetensors"), framework="pt") as checkpoint:
        for layer in model.layers:
            assert isinstance(layer, DecoderLayer)
            moe = layer.mlp
            if not isinstance(moe, MoE):
                continue
            assert (moe.w_gate_up.dtype, moe.w_down.dtype) == (FP8_DTYPE, FP8_DTYPE)
            assert moe.first_expert == 8 and moe.w_down.shape[0] == 8
            assert moe.w_down_scale is not None and moe.w_gate_up_scale is not None
            for local, expert in enumerate(range(8, 16)):
                prefix = f"model.layers.{layer.index}.mlp.experts.{expert}."
                down = checkpoint.get_tensor(prefix + "down_proj.weight")
                gate = checkpoint.get_tensor(prefix + "gate_proj.weight")
                assert down.dtype == FP8_DTYPE
                assert torch.equal(moe.w_down[local].view(torch.uint8), down.view(torch.uint8))
                assert torch.equal(
                    moe.w_gate_up[local, : gate.shape[0]].view(torch.uint8), gate.view(torch.uint8)
                )
                assert torch.equal(
                    moe.w_down_scale[local], checkpoint.get_tensor(prefix + "down_proj.weight_scale_inv")
                )
            o_proj = layer.self_attn.o_proj
            assert o_proj.weight.dtype == FP8_DTYPE and o_proj.weight_scale_inv is not None
    # what it holds is what the same model built on the meta device would: nothing else resident
    meta = DeepseekV3(cfg, torch.float64, "meta", experts=range(8, 16), dispatcher=dispatcher)
    dequantised = DeepseekV3(
        cfg, torch.float64, "meta", experts=range(8, 16), dispatcher=dispatcher, keep_fp8=False
    )
    assert model.weight_bytes() == meta.weight_bytes() < dequantised.weight_bytes()
