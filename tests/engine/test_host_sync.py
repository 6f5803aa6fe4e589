"""No step reads a device value on the host between its launch and its sampling: the guard's CPU
stand-in over the Triton kernels (the GPU's path), on mixed steps (a prompt's chunk beside other
requests' decode rows) and decode steps; and the guard itself names the line that reads."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.host_sync import HostSyncError, no_host_sync
from tandem.engine.runner import ModelRunner
from tandem.model.kernels.moe import fused_experts_torch
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.wire.request_params import SamplingParams

# a long prompt whose chunks (budget 16 tokens a step) run beside the short ones' decode rows
PROMPTS = [[5, 9, 13], [100, 101], [7 + i % 50 for i in range(40)]]


def _engine(tiny: Path, guard: bool, device: str = "cpu") -> ColocatedEngine:
    config = EngineConfig(num_pages=16, page_size=8, max_num_seqs=4, max_num_batched_tokens=16)
    engine = ColocatedEngine.from_model_dir(tiny, config=config, device=device)
    engine.runner = ModelRunner(engine.model, engine.pool, guard_syncs=guard)
    return engine


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's sync debug mode needs a GPU")
def test_on_a_gpu_no_launch_synchronises(tmp_path: Path) -> None:
    """The same steps under ``torch.cuda.set_sync_debug_mode("error")``: any synchronising call
    inside a launch raises."""
    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    sampling = [SamplingParams(max_tokens=6, ignore_eos=True) for _ in PROMPTS]
    guarded = _engine(tiny, guard=True, device="cuda")
    got = [o.token_ids for o in guarded.generate(PROMPTS, sampling)]
    assert guarded.runner.guarded_forwards > 0
    assert got == [o.token_ids for o in _engine(tiny, guard=False, device="cuda").generate(PROMPTS, sampling)]


def test_mixed_and_decode_steps_read_nothing_on_the_host(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_KERNELS", "triton")
    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    sampling = [SamplingParams(max_tokens=6, ignore_eos=True) for _ in PROMPTS]
    guarded = _engine(tiny, guard=True)
    assert guarded.model.ops.name == "triton"
    kinds: list[tuple[bool, bool]] = []  # each forward: (has extend rows, has decode rows)

    forward = guarded.model.forward

    def recorded(*args: Any) -> Any:
        meta = args[2]
        kinds.append((bool(meta.extend_rows), bool(meta.decode_rows)))
        return forward(*args)

    monkeypatch.setattr(guarded.model, "forward", recorded)
    got = [o.token_ids for o in guarded.generate(PROMPTS, sampling)]
    assert (True, True) in kinds and (False, True) in kinds  # mixed steps and decode steps ran
    assert guarded.runner.guarded_forwards == len(kinds)
    want = [o.token_ids for o in _engine(tiny, guard=False).generate(PROMPTS, sampling)]
    assert got == want


def test_the_guard_names_the_line_that_reads_a_device_value() -> None:
    """The torch reference of the experts reads the expert ids back (it loops over them on the
    host): fine as a reference, and exactly what the guard exists to catch."""
    x = torch.randn(4, 8)
    w_gate_up, w_down = torch.randn(2, 6, 8), torch.randn(2, 8, 3)
    args = (x, torch.ones(4, 1), torch.zeros(4, 1, dtype=torch.int64), w_gate_up, w_down, 0)
    expected = fused_experts_torch(*args)
    with no_host_sync(torch.device("cpu")), pytest.raises(HostSyncError) as caught:
        fused_experts_torch(*args)
    assert caught.value.method == "tolist" and caught.value.where.startswith("model/kernels/moe.py:")
    # outside the block every read works again
    torch.testing.assert_close(fused_experts_torch(*args), expected)
