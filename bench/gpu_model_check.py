"""On a CUDA GPU: the tiny model end to end, its Triton kernels compiled for the GPU, against the
torch reference on the CPU. The colocated engine runs the same prompts (a shared prefix, so the
prefix cache and the extend kernel over cached pages take part; prompts of one token, so the
absorbed decode runs from the first step) on both; the greedy tokens must match.

``python -m tandem.bench.gpu_model_check`` prints one line per prompt that differs and a summary;
it exits 0 when every prompt matches, 1 when one does not, 2 without a GPU.
"""

from __future__ import annotations

import random
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.wire.request_params import SamplingParams


def main() -> int:
    if not torch.cuda.is_available():
        print("no CUDA GPU visible to torch", file=sys.stderr)
        return 2
    rng = random.Random(0)
    system = [rng.randrange(256) for _ in range(40)]
    prompts = [system + [rng.randrange(256) for _ in range(rng.randrange(1, 30))] for _ in range(8)]
    prompts += [[5], [7, 8, 9]]
    sampling = SamplingParams(max_tokens=16, ignore_eos=True)
    config = EngineConfig(page_size=8, num_pages=512)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        gpu = ColocatedEngine.from_model_dir(tiny, torch.float32, config, device="cuda")
        cpu = ColocatedEngine.from_model_dir(tiny, torch.float32, config, device="cpu")
    # the first prompt alone puts the shared prefix in the cache (and compiles the GPU's kernels)
    got, want = gpu.generate(prompts[:1], sampling), cpu.generate(prompts[:1], sampling)
    start = time.perf_counter()
    got += gpu.generate(prompts[1:], sampling)
    torch.cuda.synchronize()
    gpu_s = time.perf_counter() - start
    start = time.perf_counter()
    want += cpu.generate(prompts[1:], sampling)
    cpu_s = time.perf_counter() - start
    differ = 0
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        if g.token_ids != w.token_ids:
            differ += 1
            first = next(k for k, (a, b) in enumerate(zip(g.token_ids, w.token_ids, strict=True)) if a != b)
            print(f"prompt {i}: tokens differ from output {first}: gpu {g.token_ids} cpu {w.token_ids}")
    cached = (sum(o.cached_tokens for o in got), sum(o.cached_tokens for o in want))
    print(
        f"backends gpu={gpu.model.ops.name} cpu={cpu.model.ops.name}; {len(prompts) - differ}/{len(prompts)} "
        f"prompts give the same greedy tokens; cached prompt tokens gpu {cached[0]} cpu {cached[1]}; "
        f"wall s gpu {gpu_s:.2f} cpu {cpu_s:.2f} (same run, tiny model)"
    )
    return 0 if differ == 0 and cached[0] == cached[1] else 1


if __name__ == "__main__":
    sys.exit(main())
