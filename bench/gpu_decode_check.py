"""On a CUDA GPU: the decode step at batch 1 and 64, eager against static shapes replayed as CUDA
graphs (``engine/static_decode.py``, every bucket captured at start), on the tiny model with its
Triton kernels. Both engines run the same greedy prompts; the tokens must match, and each decode
step is timed whole (the sampler reads the tokens back, so a step's wall time is its device time
too). Both then run again with the sync guard (``ModelRunner(guard_syncs=True)``: every launch
under ``torch.cuda.set_sync_debug_mode("error")``), mixed prefill-and-decode steps included: any
host sync inside a forward fails the check.

``python -m tandem.bench.gpu_decode_check`` prints a table; it exits 0 when the tokens match and
no launch synchronised, 1 otherwise, 2 without a GPU.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.bench.engine_bench import run_batch
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.runner import ModelRunner
from tandem.engine.static_decode import StaticDecode
from tandem.model.deepseek import DeepseekV3
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.wire.request_params import SamplingParams

BATCHES = (1, 64)


def _engines(tiny: Path, guard: bool = False) -> tuple[ColocatedEngine, ColocatedEngine]:
    batch = max(BATCHES)
    config = EngineConfig(page_size=16, num_pages=2048, max_num_seqs=batch, enable_prefix_caching=False)
    eager = ColocatedEngine.from_model_dir(tiny, torch.float32, config, device="cuda")
    graphs = ColocatedEngine.from_model_dir(tiny, torch.float32, config, device="cuda")
    assert isinstance(eager.model, DeepseekV3) and isinstance(graphs.model, DeepseekV3)  # the tiny V3
    assert eager.pool is not None and graphs.pool is not None
    eager.runner = ModelRunner(eager.model, eager.pool, guard_syncs=guard)
    static = StaticDecode(graphs.model, graphs.pool, max(BATCHES), graphs.max_model_len, graphs=True)
    start = time.perf_counter()
    captured = static.capture_all()
    if not guard:
        print(f"{len(captured)} buckets captured at start in {time.perf_counter() - start:.2f} s: {captured}")
    graphs.runner = ModelRunner(graphs.model, graphs.pool, static=static, guard_syncs=guard)
    return eager, graphs


def _guarded(tiny: Path, prompts: list[list[int]], want: list[list[int]]) -> bool:
    """Both engines under the sync guard: the same tokens, and no launch synchronised (CUDA's
    sync debug mode raises inside the launch if one does)."""
    eager, graphs = _engines(tiny, guard=True)
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    try:
        outputs = [[o.token_ids for o in e.generate(prompts, sampling)] for e in (eager, graphs)]
    except RuntimeError as error:  # "called a synchronizing CUDA operation"
        print(f"sync guard: a launch synchronised with the host: {error}")
        return False
    forwards = [e.runner.guarded_forwards for e in (eager, graphs)]
    same = all(out == [w[:8] for w in want] for out in outputs)
    print(f"sync guard: {forwards[0]} eager and {forwards[1]} graph launches, none synchronised; "
          f"tokens {'match' if same else 'DIFFER'}")  # fmt: skip
    return same


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU visible to torch", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        eager, graphs = _engines(tiny)
        rng = random.Random(0)
        prompts = [[rng.randrange(256) for _ in range(rng.randrange(8, 100))] for _ in range(max(BATCHES))]
        sampling = SamplingParams(max_tokens=24, ignore_eos=True)
        want = [o.token_ids for o in eager.generate(prompts, sampling)]
        got = [o.token_ids for o in graphs.generate(prompts, sampling)]
        guard_ok = _guarded(tiny, prompts, want)
    differ = sum(a != b for a, b in zip(got, want, strict=True))
    print(f"{'batch':>6} {'eager ms':>10} {'graphs ms':>10} {'speed-up':>9}")
    for batch in BATCHES:
        for engine in (eager, graphs):  # warm: kernels compiled, every bucket captured
            run_batch(engine, batch, 64, 4, seed=1, temperature=0.0)
        e = run_batch(eager, batch, 64, 64, seed=batch, temperature=0.0)["decode_step_ms"]
        g = run_batch(graphs, batch, 64, 64, seed=batch, temperature=0.0)["decode_step_ms"]
        print(f"{batch:>6} {e:>10.3f} {g:>10.3f} {e / g:>8.2f}x")
    same = len(prompts) - differ
    print(f"{same}/{len(prompts)} prompts give the eager path's greedy tokens with CUDA graphs")
    return 0 if differ == 0 and guard_ok else 1


if __name__ == "__main__":
    sys.exit(main())
