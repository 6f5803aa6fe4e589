"""``bench/serve_workload.py``: token ids made from the seed and the trace's hash ids, sharing
preserved, lengths scaled and clipped as documented."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tandem.bench.router_bench import TraceRequest
from tandem.bench.serve_workload import SyntheticWorkload, TraceReplay, block_token_ids


def entry(arrival_s: float, input_length: int, output_length: int, hash_ids: list[int]) -> TraceRequest:
    return TraceRequest(arrival_s, input_length, output_length, tuple(hash_ids))


def test_the_same_hash_id_gives_the_same_tokens_in_the_vocabulary() -> None:
    assert block_token_ids(7, 64, 256) == block_token_ids(7, 64, 256)
    assert block_token_ids(7, 64, 256) != block_token_ids(8, 64, 256)
    assert block_token_ids(7, 64, 256, seed=1) != block_token_ids(7, 64, 256)
    tokens = block_token_ids(3, 5000, 256)
    assert min(tokens) >= 0 and max(tokens) < 256 and len(set(tokens)) > 200


def test_a_replay_keeps_whole_shared_blocks_under_block_tokens() -> None:
    replay = TraceReplay(block_tokens=64, context_tokens=100_000)
    a, b = replay.requests([entry(1.0, 3 * 512, 10, [0, 1, 2]), entry(3.5, 2 * 512 + 100, 20, [0, 1, 9])])
    assert len(a.prompt) == 192 and len(b.prompt) == round((2 * 512 + 100) * 64 / 512)  # 141
    assert a.prompt[:128] == b.prompt[:128]  # blocks 0 and 1, 64 tokens each
    assert a.prompt[128:141] != b.prompt[128:141]  # block 2 against block 9
    assert a.prompt[:64] == block_token_ids(0, 64, 256)
    assert (a.max_tokens, b.max_tokens) == (10, 20)
    assert (a.send_at_s, b.send_at_s) == (0.0, 2.5)  # from the slice's first arrival
    assert TraceReplay(block_tokens=64, context_tokens=100_000, time_scale=0.1).requests(
        [entry(1.0, 512, 1, [0]), entry(3.5, 512, 1, [1])]
    )[1].send_at_s == pytest.approx(0.25)


def test_a_replay_caps_outputs_and_clips_what_passes_the_context() -> None:
    replay = TraceReplay(block_tokens=512, context_tokens=2048, max_output_tokens=100)
    fits, long, no_output = replay.requests(
        [entry(0, 1000, 500, [0, 1]), entry(1, 6758, 500, list(range(14))), entry(2, 10, 0, [])]
    )
    assert (len(fits.prompt), fits.max_tokens, fits.clipped) == (1000, 100, False)
    assert (len(long.prompt), long.max_tokens, long.clipped) == (1948, 100, True)
    assert long.prompt[:512] == fits.prompt[:512]  # the shared first block survives the clip
    assert (len(no_output.prompt), no_output.max_tokens) == (10, 1)  # a trace block list may be empty


def test_synthetic_prompts_share_their_prefix_and_differ_after_it() -> None:
    work = SyntheticWorkload(
        prompt_tokens=100, output_tokens=8, shared_prefix_tokens=64, prefixes=2, vocab_size=50
    )
    r0, r1, r2 = (work.request(point=0, index=i) for i in range(3))
    assert len(r0.prompt) == 100 and r0.max_tokens == 8
    assert r0.prompt[:64] == r2.prompt[:64] != r1.prompt[:64]  # prefixes 0, 1, 0
    assert r0.prompt[64:] != r2.prompt[64:]
    assert work.request(point=1, index=0).prompt[:64] == r0.prompt[:64]  # the next point meets it too
    assert work.request(point=0, index=0) == r0
    assert max(max(r.prompt) for r in (r0, r1, r2)) < 50
    with pytest.raises(ValueError, match="--shared-prefix-tokens: 200 is longer than --prompt-tokens 100"):
        SyntheticWorkload(100, 8, 200, 2, 50).check()


def test_token_ids_are_the_same_in_another_process() -> None:
    code = "from tandem.bench.serve_workload import block_token_ids; print(block_token_ids(42, 16, 256))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == str(block_token_ids(42, 16, 256))


def test_the_benchmark_imports_neither_torch_nor_ray() -> None:
    code = (
        "import sys, tandem.bench.serve_bench, tandem.bench.serve_report, tandem.bench.serve_plots\n"
        "assert 'torch' not in sys.modules and 'ray' not in sys.modules, 'torch or ray imported'\n"
        "assert 'matplotlib' not in sys.modules, 'matplotlib imported without --plot'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
