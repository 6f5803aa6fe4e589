"""On a CUDA GPU: a layer-wise KV transfer between two GPU pools, checked byte for byte.

A prefill worker and a decode worker in one process, each with a pool in VRAM and its own NIXL
agent, run prompts through the disaggregated path with layer-wise writes: each layer's writes
wait for the CUDA event recorded after that layer's kernels. The model's attention is slowed
on the GPU (a spin kernel queued before each layer's attention, so the host runs far ahead of
the device, as it does on a real model), which is when a write posted without waiting would
read KV not yet computed. After each transfer every (layer, page) the decode rank received is
compared with the prefill rank's source page, and the decoded tokens with the colocated
engine's on the CPU.

``python -m tandem.bench.gpu_transfer_check`` prints one line per prompt and a summary; it exits
0 when every page and token matches, 1 when one does not, 2 without a GPU. ``--device cpu``
runs the same check between two host pools (no slowed attention), to check the check.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from tandem.decode.decode_request import Routing
from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.types import DecodeSchedulerConfig
from tandem.decode.worker import DecodeWorker, PrefillDispatcher
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.kvtransfer.metadata import InMemoryMetadataStore
from tandem.kvtransfer.nixl_transport import NixlTransport
from tandem.kvtransfer.types import KVDestination
from tandem.model.checkpoint import load_checkpoint
from tandem.model.config import ModelConfig
from tandem.model.deepseek import DeepseekV3
from tandem.model.kv_pool import KVPool
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.prefill.scheduler import PrefillScheduler, PrefillSchedulerConfig
from tandem.prefill.worker import PrefillWorker
from tandem.wire.messages import RankId
from tandem.wire.prefill_job import PrefillJob
from tandem.wire.request_params import SamplingParams

PAGE, PREFILL_PAGES, DECODE_PAGES = 8, 128, 128
PREFILL, DECODE = RankId("prefill", 0), RankId("decode", 0)


class DirectDispatcher(PrefillDispatcher):
    """Every job straight to one prefill worker in this process (no Ray, no router)."""

    def __init__(self, worker: PrefillWorker) -> None:
        self.worker = worker

    def choose(self, request: Request, preferred: RankId | None = None) -> RankId:
        return PREFILL

    def send(self, prefill_rank: RankId, job: PrefillJob) -> None:
        self.worker.submit([(job, time.monotonic())])

    def set_ranks(self, ranks: dict[RankId, object]) -> None:
        raise AssertionError("one prefill rank")


class _RecordingTransport(NixlTransport):
    """The NIXL transport, remembering each send's source and destination pages."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.pages: dict[str, tuple[list[int], list[int]]] = {}

    def begin_send(
        self,
        request_id: str,
        dest: KVDestination,
        src_page_ids: Sequence[int],
        timeout_s: float,
        src_slot: int | None = None,
    ) -> None:
        super().begin_send(request_id, dest, src_page_ids, timeout_s, src_slot)
        self.pages[request_id] = (list(src_page_ids), list(dest.page_ids))


def _spin_before_attention(model: DeepseekV3, cycles: int) -> None:
    """Queue ``cycles`` of GPU spinning before each layer's attention: the device lags the host."""
    for layer in model.layers:
        layer.self_attn.register_forward_pre_hook(  # type: ignore[union-attr]
            lambda module, args: torch.cuda._sleep(cycles)
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tandem.bench.gpu_transfer_check")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    device = parser.parse_args(argv).device
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA GPU visible to torch", file=sys.stderr)
        return 2
    rng = random.Random(0)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(20, 120))] for _ in range(6)]
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    with tempfile.TemporaryDirectory() as tmp:
        tiny = make_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        cfg = ModelConfig.from_dir(tiny)
        weights = load_checkpoint(tiny, cfg, torch.float32)
        cpu = ColocatedEngine.from_model_dir(tiny, torch.float32, EngineConfig(page_size=PAGE, num_pages=512))
    pair = _Pair(cfg, weights, device)
    want = cpu.generate(prompts, [sampling] * len(prompts))
    bad = 0
    for i, prompt in enumerate(prompts):
        problems = pair.serve(f"p{i}", prompt, sampling, want[i].token_ids)
        for problem in problems:
            print(f"prompt {i}: {problem}")
        if not problems:
            print(f"prompt {i}: {len(prompt)} tokens, pages and tokens match")
        bad += bool(problems)
    pair.close()
    path = f"{pair.p_pool.layout.mem_type} to {pair.d_pool.layout.mem_type}"
    print(f"gpu transfer check: {len(prompts) - bad}/{len(prompts)} prompts match (layer-wise, {path})")
    return 1 if bad else 0


class _Pair:
    """A prefill worker and a decode worker on ``device``, the KV written layer by layer over
    NIXL, driven by hand on this thread."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], device: str) -> None:
        self.device = device
        models = [DeepseekV3(cfg, torch.float32, device) for _ in range(2)]
        for model in models:
            model.load_weights(weights)
        if device == "cuda":
            _spin_before_attention(models[0], 50_000_000)  # tens of milliseconds a layer
        store = InMemoryMetadataStore()
        self.p_pool = KVPool(cfg, PREFILL_PAGES, PAGE, torch.float32, device)
        self.d_pool = KVPool(cfg, DECODE_PAGES, PAGE, torch.float32, device)
        self.sender = _RecordingTransport(PREFILL.name, 1, self.p_pool.layout, store)
        config = PrefillSchedulerConfig(
            num_pages=PREFILL_PAGES,
            page_size=PAGE,
            max_num_batched_tokens=256,
            max_model_len=512,
            vocab_size=cfg.vocab_size,
        )
        runner = ModelRunner(models[0], self.p_pool)
        self.prefill = PrefillWorker(
            PREFILL, 1, PrefillScheduler(config), runner, self.sender, layerwise=True
        )
        self.decode = DecodeWorker(
            DECODE,
            1,
            DecodeScheduler(DecodeSchedulerConfig(num_pages=DECODE_PAGES, page_size=PAGE, max_model_len=512)),
            ModelRunner(models[1], self.d_pool),
            NixlTransport(DECODE.name, 1, self.d_pool.layout, store),
            DirectDispatcher(self.prefill),
        )

    def serve(
        self, request_id: str, prompt: list[int], sampling: SamplingParams, want: list[int]
    ) -> list[str]:
        """One request through both; what went wrong (nothing: the pages and tokens match)."""
        prefill, decode, problems = self.prefill, self.decode, []
        decode.submit(
            [(Request(request_id, prompt, sampling, frozenset(), 512), Routing(), time.monotonic())]
        )
        checked, result = False, None
        deadline = time.monotonic() + 60
        while result is None and time.monotonic() < deadline:
            decode.tick()
            prefill.tick()
            if prefill.has_work():
                prefill.step()
            if not checked and decode.scheduler.num_running:  # the KV arrived: compare it now
                key = next(k for k in self.sender.pages if k.startswith(request_id))
                src, dst = self.sender.pages[key]
                if self.device == "cuda":
                    torch.cuda.synchronize()
                checked = True
                if not torch.equal(self.p_pool.kv[:, src].cpu(), self.d_pool.kv[:, dst].cpu()):
                    problems.append("decode pages differ from the prefill pages after the transfer")
            if decode.has_work():
                decode.step()
            results = decode.take_results()
            result = results[0] if results else None
        if result is None or list(result.token_ids) != want:
            problems.append(f"tokens {None if result is None else list(result.token_ids)} != {want}")
        return problems

    def close(self) -> None:
        self.sender.close()
        self.decode.transport.close()


if __name__ == "__main__":
    sys.exit(main())
