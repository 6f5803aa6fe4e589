"""A DEP2 group's decode steps at static shapes: every bucket captured at start (the CPU stand-in
of CUDA graphs, which replays the recorded forward over its static buffers), each step's bucket
agreed by the two ranks (one with three rows, one with one, then one idle), the experts exchanged
in fixed-capacity buffers; the tokens are those of the whole model in one process, eager."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tandem.cluster.rank_setup import load_rank_model
from tandem.engine.runner import ModelRunner
from tandem.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from tandem.engine.static_decode import RerunRecorder, StaticDecode
from tandem.model.kv_pool import KVPool
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.wire.request_params import SamplingParams

PAGE_SIZE, PAGES, BUCKETS = 8, 24, (1, 2, 4)
# rank -> its requests: (prompt, output tokens); rank 1 finishes first and then steps idle
REQUESTS = {
    0: [([5, 9, 13, 40, 41], 5), ([100, 101, 7], 5), ([3] * 10, 5)],
    1: [([17, 18, 19, 20], 2)],
}
STEPS = 5


def _decode(runner: ModelRunner, requests: list[tuple[list[int], int]]) -> list[list[int]]:
    """Prefill every request in one step, then one decode step at a time for ``STEPS`` steps (a
    request past its output count is left out of the plan; the rank still steps)."""
    sampling = SamplingParams(max_tokens=8, ignore_eos=True)
    pages, next_page = [], 0
    for prompt, count in requests:
        need = -(-(len(prompt) + count) // PAGE_SIZE)
        pages.append(tuple(range(next_page, next_page + need)))
        next_page += need
    chunks = [
        ScheduledChunk(f"r{i}", tuple(p), 0, pages[i], True, sampling, 0) for i, (p, _) in enumerate(requests)
    ]
    sampled = runner.run(SchedulerOutput(tuple(chunks), sum(len(p) for p, _ in requests), ()))
    outputs = [[sampled[f"r{i}"]] for i in range(len(requests))]
    for _ in range(STEPS - 1):
        chunks = [
            ScheduledChunk(f"r{i}", (out[-1],), len(p) + len(out) - 1, pages[i], True, sampling, len(out))
            for i, ((p, count), out) in enumerate(zip(requests, outputs, strict=True))
            if len(out) < count
        ]
        sampled = runner.run(SchedulerOutput(tuple(chunks), len(chunks), ()))
        for i, out in enumerate(outputs):
            if f"r{i}" in sampled:
                out.append(sampled[f"r{i}"])
    return outputs


def _rank(rank: int, out_dir: str, tiny: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{out_dir}/rendezvous", rank=rank, world_size=2)
    cfg, model, dispatcher = load_rank_model(tiny, "float64", torch.device("cpu"), rank, 2)
    pool = KVPool(cfg, PAGES, PAGE_SIZE, torch.float64, "cpu", model.num_kv_layers)
    static = StaticDecode(model, pool, max(BUCKETS), 64, buckets=BUCKETS, recorder=RerunRecorder())
    captured = static.capture_all()  # at start, both ranks together: the captures exchange rows
    exchanged_at_start = dispatcher.stats.layers
    runner = ModelRunner(model, pool, lockstep=True, static=static)
    outputs = _decode(runner, REQUESTS[rank])
    torch.save(
        {
            "outputs": outputs,
            "captured": captured,
            "exchanged_at_start": exchanged_at_start,
            "padded_rows": static.padded_rows,
            "pool_written": pool.kv.abs().sum(dim=(0, 2, 3)) != 0,  # per page
        },
        f"{out_dir}/{rank}.pt",
    )
    dist.destroy_process_group()


def test_a_dep2_group_decodes_at_agreed_buckets_captured_at_start(tmp_path: Path) -> None:
    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    mp.spawn(_rank, args=(str(tmp_path), str(tiny)), nprocs=2)

    cfg, whole, _ = load_rank_model(str(tiny), "float64", torch.device("cpu"), 0, 1)
    for rank, requests in REQUESTS.items():
        pool = KVPool(cfg, PAGES, PAGE_SIZE, torch.float64, "cpu", whole.num_kv_layers)
        want = _decode(ModelRunner(whole, pool), requests)
        result = torch.load(tmp_path / f"{rank}.pt")
        assert result["outputs"] == want, rank
        assert [len(out) for out in want] == [count for _, count in requests]
        assert result["captured"] == BUCKETS
        # each capture ran every MoE layer's exchange once, on both ranks alike
        moe_layers = sum(1 for i in range(cfg.num_hidden_layers) if cfg.is_moe_layer(i))
        assert result["exchanged_at_start"] == len(BUCKETS) * moe_layers
        # 4 decode steps at the agreed bucket of 4: rank 0 pads 1 row a step, rank 1 pads 3 a
        # step while it has its request, then 4 idle
        assert result["padded_rows"] == (4 * 1 if rank == 0 else 3 + 4 * 3)
        # the captures (all padding) wrote no page: only the requests' pages hold KV
        used = sum(-(-(len(p) + n) // PAGE_SIZE) for p, n in requests)
        assert result["pool_written"].nonzero().flatten().tolist() == list(range(used))
