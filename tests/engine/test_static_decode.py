"""Decode batches at static bucket shapes (the path CUDA graphs capture) give the eager path's
tokens and leave the KV pool as it does: padding rows write nothing."""

from __future__ import annotations

import pytest
import torch

from tandem.cluster.serve import demo_model_dir
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.runner import ModelRunner
from tandem.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from tandem.engine.static_decode import StaticDecode, default_buckets, static_decode_enabled
from tandem.wire.request_params import SamplingParams

SEEDS = (1, 2, 3)
PROMPTS = [[5, 9, 13, 40, 41, 42, 7], [100, 101], [3] * 70]  # the last one spans two pages


def _engine(static: bool) -> ColocatedEngine:
    config = EngineConfig(num_pages=16, page_size=64, max_num_seqs=4, enable_prefix_caching=False)
    engine = ColocatedEngine.from_model_dir(demo_model_dir(), config=config)
    if static:
        decode = StaticDecode(engine.model, engine.pool, 4, engine.max_model_len, buckets=(1, 2, 4))
        engine.runner = ModelRunner(engine.model, engine.pool, static=decode)
    return engine


@pytest.mark.parametrize(
    "sampling",
    [
        [SamplingParams(max_tokens=n, ignore_eos=True) for n in (12, 5, 9)],  # batches of 3, 2, 1
        [SamplingParams(max_tokens=10, ignore_eos=True, temperature=0.8, top_p=0.9, seed=s) for s in SEEDS],
    ],
    ids=["greedy", "seeded"],
)
def test_static_decode_gives_the_eager_tokens_and_pool(sampling: list[SamplingParams]) -> None:
    eager, static = _engine(False), _engine(True)
    want = eager.generate(PROMPTS, sampling)
    got = static.generate(PROMPTS, sampling)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    # the same slots written (padding rows wrote none), values equal up to the rounding of
    # matrix products of another batch shape
    assert torch.equal(static.pool.kv != 0, eager.pool.kv != 0)
    torch.testing.assert_close(static.pool.kv, eager.pool.kv, rtol=1e-5, atol=1e-5)
    decode = static.runner.static
    assert decode is not None and decode.padded_rows > 0  # 3 rows ran as a bucket of 4


def _plan(chunks: list[ScheduledChunk]) -> SchedulerOutput:
    return SchedulerOutput(tuple(chunks), len(chunks), ())


def test_inputs_have_their_buckets_shape_and_padding_writes_nowhere() -> None:
    engine = _engine(True)
    decode = engine.runner.static
    assert decode is not None
    sampling = SamplingParams(max_tokens=2)
    chunks = [
        ScheduledChunk("a", (7,), 64, (2, 5), True, sampling, 0),  # position 64: page 5, slot 0
        ScheduledChunk("b", (8,), 3, (1,), True, sampling, 0),
        ScheduledChunk("c", (9,), 0, (4,), True, sampling, 0),
    ]
    ids, positions, meta = decode.inputs(_plan(chunks))
    max_pages = engine.max_model_len // 64
    assert ids.tolist() == [7, 8, 9, 0] and positions.tolist() == [64, 3, 0, 0]
    assert meta.page_table.shape == (4, max_pages) and meta.max_seq_len == engine.max_model_len
    assert meta.slot_mapping.tolist() == [5 * 64, 64 + 3, 4 * 64, -1]
    assert meta.seq_lens == [65, 4, 1, 1] and meta.query_start.tolist() == [0, 1, 2, 3, 4]
    assert decode.bucket(5) is None and not decode.applies(_plan(chunks * 2))


def test_buckets_and_the_switch() -> None:
    assert default_buckets(1) == (1,)
    assert default_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert default_buckets(100)[-2:] == (96, 100)
    assert static_decode_enabled("cuda") and not static_decode_enabled("cpu")


def test_the_switch_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TANDEM_STATIC_DECODE", "1")
    assert static_decode_enabled("cpu")
    monkeypatch.setenv("TANDEM_STATIC_DECODE", "yes")
    with pytest.raises(ValueError, match="TANDEM_STATIC_DECODE: expected 0 or 1"):
        static_decode_enabled("cpu")


def test_verify_steps_run_at_static_shapes_and_give_the_eager_tokens_and_pool() -> None:
    """A verify step (each request's last token and its drafts, of different lengths) is a row a
    position: at its bucket's shape it gives the eager path's tokens and KV, and with drafts that
    are plain decoding's own tokens it gives exactly those, plus the next."""
    from tandem.model.attention_metadata import AttentionMetadata

    runs = []
    for static in (False, True):
        engine = _engine(False)
        model, pool = engine.model, engine.pool
        prompts = [PROMPTS[0], PROMPTS[2]]
        pages = [[1, 2], [5, 6, 7]]
        for prompt, own in zip(prompts, pages, strict=True):  # the prompts' KV, as prefill leaves it
            n = len(prompt) - 1
            meta = AttentionMetadata.build(64, [n], [n], [own])
            model.forward(torch.tensor(prompt[:-1]), torch.arange(n), meta, pool)
        decode = StaticDecode(model, pool, 8, engine.max_model_len, buckets=(4, 8)) if static else None
        runner = ModelRunner(model, pool, static=decode)
        greedy = SamplingParams(max_tokens=32)
        # plain decoding's next tokens of request 0, computed one step at a time on a copy
        plain_pool = pool.kv.clone()
        tokens, position = [prompts[0][-1]], len(prompts[0]) - 1
        for i in range(3):
            chunk = ScheduledChunk("p", (tokens[-1],), position + i, tuple(pages[0]), True, greedy, 1 + i)
            tokens.append(runner.run(SchedulerOutput((chunk,), 1, ()))["p"])
        pool.kv.copy_(plain_pool)
        drafts = (tuple(tokens[1:3]), (17, 23, 5))  # request 0's are right, request 1's wrong
        chunks = tuple(
            ScheduledChunk(
                f"r{i}", (prompt[-1], *d), len(prompt) - 1, tuple(own), True, greedy, 1, draft_token_ids=d
            )
            for i, (prompt, own, d) in enumerate(zip(prompts, pages, drafts, strict=True))
        )
        padded = decode.padded_rows if decode is not None else 0
        got = runner.verify(SchedulerOutput(chunks, 7, ()))
        assert got["r0"] == tuple(tokens[1:4])  # both drafts kept, then the next token
        assert decode is None or decode.padded_rows - padded == 1  # 7 rows in the bucket of 8
        runs.append((got, pool.kv.clone()))
    (eager, eager_kv), (static_got, static_kv) = runs
    assert static_got == eager
    assert torch.equal(static_kv != 0, eager_kv != 0)  # the same slots: padding wrote none
    torch.testing.assert_close(static_kv, eager_kv, rtol=1e-5, atol=1e-5)
