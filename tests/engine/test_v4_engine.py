"""DeepSeek-V4 through Tandem's colocated engine (scheduler, continuous batching, chunked
prefill, preemption by recompute) against transformers' ``DeepseekV4ForCausalLM.generate``:
greedy tokens equal, for prompts of 5 to 300 tokens run together (mixed steps: prefill chunks
beside decode rows), whatever the chunk size, and after preemptions. With a sparse indexer the
reference is transformers under the lowest-index tie rule (``tests/hf_v4_reference.py``)."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.cli.main import main
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from tandem.engine.v4_runner import V4Runner
from tandem.model.v4.compressor import PagedRows
from tandem.model.v4.kv_layout import request_bytes, v4_kinds
from tandem.wire.request_params import SamplingParams
from tests.hf_v4_reference import hf_greedy, hf_v4, lowest_index_ties, write_tiny_v4

PROMPTS = [[random.Random(n).randrange(256) for _ in range(n)] for n in (5, 17, 64, 131, 300)]
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def sparse(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    """A tiny V4 whose indexer keeps 3 compressed entries, and transformers' tokens for it."""
    directory = tmp_path_factory.mktemp("sparse") / "model"
    write_tiny_v4(directory, seed=3, index_topk=3)
    hf = hf_v4(directory)
    with lowest_index_ties():
        return directory, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


@pytest.fixture(scope="module")
def dense(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[list[int]]]:
    directory = tmp_path_factory.mktemp("dense") / "model"
    write_tiny_v4(directory, seed=5, hc_mult=4)
    hf = hf_v4(directory)
    return directory, [hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]


def _generate(model_dir: Path, **config: Any) -> tuple[list[list[int]], ColocatedEngine, list[str]]:
    """The engine's tokens for every prompt, run together, and the requests its steps preempted."""
    engine = ColocatedEngine.from_model_dir(model_dir, config=EngineConfig(page_size=16, **config))
    preempted: list[str] = []
    schedule = engine.scheduler.schedule

    def recording() -> SchedulerOutput:
        plan = schedule()
        preempted.extend(plan.preempted_request_ids)
        return plan

    engine.scheduler.schedule = recording  # type: ignore[method-assign]
    outputs = engine.generate(PROMPTS, GREEDY)
    return [o.token_ids for o in outputs], engine, preempted


def test_every_prompt_at_once_gives_transformers_tokens(dense: tuple[Path, list[list[int]]]) -> None:
    model_dir, want = dense
    got, engine, _ = _generate(model_dir)
    assert got == want
    assert isinstance(engine.runner, V4Runner) and engine.runner.states == {}  # each went with its request
    assert engine.scheduler.config.page_size == 16  # a multiple of the tiny model's rates 4 and 16


@pytest.mark.parametrize("chunk", [None, 7, 1])
def test_a_sparse_indexer_gives_transformers_tokens_whatever_the_chunk(
    sparse: tuple[Path, list[list[int]]], chunk: int | None
) -> None:
    """Each step's batch mixes chunks of several prompts and decode rows; with ``chunk`` a
    prompt takes many steps, its state carried from one to the next."""
    model_dir, want = sparse
    got, _, _ = _generate(model_dir, prefill_chunk_tokens=chunk, max_num_batched_tokens=64)
    assert got == want


@pytest.mark.parametrize(("prefix_caching", "window_share"), [(False, 1.0), (True, 1.0), (True, 0.125)])
def test_preemption_and_recompute_give_the_same_tokens(
    sparse: tuple[Path, list[list[int]]], prefix_caching: bool, window_share: float
) -> None:
    """Too few pages for all five requests at once: the newest are preempted and recomputed,
    from their first token (a fresh state) or, with prefix caching, from the pages of theirs
    still cached (a rebuilt state, when every page keeps its window; with an eighth, from
    those whose slots are left), and their tokens do not change."""
    model_dir, want = sparse
    got, engine, preempted = _generate(
        model_dir,
        num_pages=30,
        prefill_chunk_tokens=32,
        enable_prefix_caching=prefix_caching,
        v4_window_share=window_share,
    )
    assert got == want
    assert preempted, "the test must preempt"
    assert isinstance(engine.runner, V4Runner)
    if window_share == 1.0:
        assert (engine.runner.restores > 0) == prefix_caching
    assert engine.pool is not None and engine.runner.slots.capacity == (
        math.ceil(30 * window_share) if prefix_caching else 0
    )


def test_a_chunk_without_its_state_is_refused_with_the_request_named(
    sparse: tuple[Path, list[list[int]]],
) -> None:
    """A chunk must start where its request's state is (a prefix-cache hit would not): refused,
    never run on a wrong state."""
    engine = ColocatedEngine.from_model_dir(sparse[0], config=EngineConfig(page_size=16))
    chunk = ScheduledChunk("r-1", tuple(PROMPTS[1][:8]), 16, (0, 1), False, GREEDY, 0)
    refused = "request r-1: a DeepSeek-V4 chunk at position 16, its state at none"
    with pytest.raises(ValueError, match=refused):
        engine.runner.run(SchedulerOutput((chunk,), 8, ()))
    assert isinstance(engine.runner, V4Runner) and engine.runner.states == {}


@pytest.mark.parametrize("chunk", [None, 5])
def test_tandem_generate_gives_transformers_tokens(
    sparse: tuple[Path, list[list[int]]], chunk: int | None, capsys: pytest.CaptureFixture[str]
) -> None:
    """``tandem generate --model <V4 directory>``, the prompt whole or 5 tokens a step."""
    model_dir, want = sparse
    args = ["generate", "--model", str(model_dir), "--prompt-ids", ",".join(map(str, PROMPTS[3]))]
    args += ["--max-tokens", str(NEW_TOKENS), "--ignore-eos", "--json"]
    if chunk is not None:
        args += ["--prefill-chunk-tokens", str(chunk)]
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["outputs"][0]["token_ids"] == want[3]


@pytest.mark.parametrize("shared", [16, 48, 100])
def test_a_prefix_cache_hit_restores_the_exact_state(
    sparse: tuple[Path, list[list[int]]], shared: int
) -> None:
    """A second request sharing the first ``shared`` prompt tokens with a finished one hits the
    pages of that prefix (16, 48, 96 tokens: inside the first CSA and HCA windows' pages, and
    past several), its state rebuilt from them; its tokens are transformers' for its prompt."""
    model_dir, _ = sparse
    # every page keeps its window and overlap, so every boundary is restorable
    engine = ColocatedEngine.from_model_dir(model_dir, config=EngineConfig(page_size=16, v4_window_share=1.0))
    first = PROMPTS[4][:130]
    second = first[:shared] + PROMPTS[3][: 140 - shared]
    engine.generate([first], GREEDY)
    [out] = engine.generate([second], GREEDY)
    assert out.cached_tokens == shared // 16 * 16
    assert isinstance(engine.runner, V4Runner) and engine.runner.states == {}
    assert engine.runner.restores == 1
    hf = hf_v4(model_dir)
    with lowest_index_ties():
        assert out.token_ids == hf_greedy(hf, second, NEW_TOKENS)


def test_mtp_drafts_from_a_v4_checkpoint_without_its_mtp_layer_are_refused_before_anything_starts(
    sparse: tuple[Path, list[list[int]]], capsys: pytest.CaptureFixture[str]
) -> None:
    """One line naming the flag and the checkpoint, before any actor starts."""
    flags = ["generate", "--prompt", "x", "--max-tokens", "2", "--preset", "local"]
    flags += ["--speculative-tokens", "2", "--drafter", "mtp"]
    assert main([*flags, "--model", str(sparse[0])]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--drafter mtp: " in err and str(sparse[0]) in err, err


def test_verified_drafts_give_plain_decodings_tokens_and_a_rejection_rolls_the_state_back(
    sparse: tuple[Path, list[list[int]]],
) -> None:
    """Verify chunks (the last token and drafts) through the V4 runner, with drafts right, wrong
    and right-then-wrong, crossing page boundaries: every step's tokens are transformers' (plain
    greedy decoding's), the state ends where the accepted tokens end, and a page only rejected
    drafts completed is not kept."""
    model_dir, want = sparse
    engine = ColocatedEngine.from_model_dir(model_dir, config=EngineConfig(page_size=16))
    runner = engine.runner
    assert isinstance(runner, V4Runner)
    prompt, target = PROMPTS[2], want[2]  # 64 tokens: the next page boundary is at 80
    pages = tuple(range(12))

    def step(tokens: tuple[int, ...], position: int, drafts: tuple[int, ...], index: int) -> tuple[int, ...]:
        chunk = ScheduledChunk("r", tokens, position, pages, True, GREEDY, index, draft_token_ids=drafts)
        return runner.verify(SchedulerOutput((chunk,), len(tokens), ()))["r"]

    out = list(step(tuple(prompt), 0, (), 0))
    wrong = lambda t: (t + 1) % 256  # noqa: E731
    patterns = [(2, 0), (0, 1), (1, 2), (3, 0), (0, 3), (2, 1), (1, 1), (0, 2)]  # (right, then wrong) drafts
    rejected_past_boundary = False
    while len(out) < NEW_TOKENS - 4:
        right, bad = patterns[len(out) % len(patterns)]
        position = len(prompt) + len(out) - 1  # the last token's
        drafts = tuple(target[len(out) : len(out) + right]) + tuple(
            wrong(t) for t in target[len(out) + right :][:bad]
        )
        got = step((out[-1], *drafts), position, drafts, len(out))
        assert list(got) == target[len(out) : len(out) + len(got)], (position, drafts)
        assert len(got) == right + 1 if bad else len(got) >= right + 1
        out.extend(got)
        assert runner.states["r"].position == len(prompt) + len(out) - 1
        end = position + 1 + len(drafts)
        if bad and end // 16 > (position + right + 1) // 16:  # rejected tokens completed a page
            rejected_past_boundary = True
            assert pages[end // 16 - 1] not in runner.written
    assert out == target[: len(out)] and rejected_past_boundary


def test_drafts_in_a_dep_group_need_a_speculative_runner(sparse: tuple[Path, list[list[int]]]) -> None:
    """A rejected draft's recompute is a forward the whole group makes, which only a runner built
    ``speculative`` agrees on with its group every step: any other refuses drafts, by name."""
    engine = ColocatedEngine.from_model_dir(sparse[0], config=EngineConfig(page_size=16))
    assert isinstance(engine.runner, V4Runner)
    runner = V4Runner(engine.runner.model, lockstep=True)
    chunk = ScheduledChunk("r", (1, 2), 0, (0,), True, GREEDY, 0, draft_token_ids=(2,))
    with pytest.raises(ValueError, match="DeepSeek-V4 drafts in a DEP group need a speculative runner"):
        runner.verify(SchedulerOutput((chunk,), 2, ()))


def test_a_running_requests_entries_live_in_its_pages_of_the_pool(
    sparse: tuple[Path, list[list[int]]],
) -> None:
    """The engine's V4 pool holds a running request's compressed entries and indexer keys, at
    its pages (any ids), and the request's state keeps no copy of them: they are the entries the
    model computes into tensors of its own."""
    engine = ColocatedEngine.from_model_dir(sparse[0], config=EngineConfig(page_size=16))
    runner, pool = engine.runner, engine.pool
    assert isinstance(runner, V4Runner) and pool is not None
    prompt, pages = PROMPTS[2], (7, 2, 11, 4)  # 64 tokens, four pages
    runner.run(SchedulerOutput((ScheduledChunk("r", tuple(prompt), 0, pages, True, GREEDY, 0),), 64, ()))
    alone = runner.model.new_state()
    runner.model(torch.tensor(prompt), torch.arange(len(prompt)), [len(prompt)], [alone])
    cfg, checked = runner.model.cfg, 0
    for index, (state, own) in enumerate(zip(runner.states["r"].layers, alone, strict=True)):
        rate = cfg.compress_rate(index)
        if not rate:
            continue
        table = pool.kind(f"compressed.{rate}", index)
        in_pages = table[torch.tensor(pages)].reshape(-1, cfg.head_dim)[: len(prompt) // rate]
        assert state.compressor.entries is None and own.compressor.entries is not None
        assert torch.equal(in_pages, own.compressor.entries)
        checked += 1
    assert checked and pool.names == ["window", "compressed.4", "compressed.16", "indexer_keys", "overlap"]


def _held_bytes(layers: list[Any]) -> int:
    """The bytes a request's state keeps alive: every tensor's storage once (not the pool's)."""
    storages: dict[int, int] = {}

    def visit(value: Any) -> None:
        if isinstance(value, torch.Tensor):
            storages[value.untyped_storage().data_ptr()] = value.untyped_storage().nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item)
        elif isinstance(value, tuple):
            for item in value:
                visit(item)
        elif dataclasses.is_dataclass(value) and not isinstance(value, PagedRows):
            for f in dataclasses.fields(value):
                visit(getattr(value, f.name))

    for state in layers:
        visit(state)
    return sum(storages.values())


@pytest.mark.parametrize("prefix_caching", [False, True])
@pytest.mark.parametrize("chunk", [300, 37])
def test_a_running_request_holds_no_more_than_the_plan_counts_for_it(
    sparse: tuple[Path, list[list[int]]], prefix_caching: bool, chunk: int
) -> None:
    """Beside its pages, a running request's state keeps what ``tandem plan memory`` counts per
    request (its window, open windows and the last window's projections), after a prompt in one
    chunk or many and decode steps: no step's tokens or projections stay alive in it."""
    engine = ColocatedEngine.from_model_dir(
        sparse[0], config=EngineConfig(page_size=16, enable_prefix_caching=prefix_caching)
    )
    runner = engine.runner
    assert isinstance(runner, V4Runner)
    prompt, pages = PROMPTS[4], tuple(range(20, 0, -1))
    kinds = v4_kinds(runner.model.cfg, runner.model.dtype.itemsize, 16, prefix_caching)
    for at in range(0, len(prompt), chunk):
        part = tuple(prompt[at : at + chunk])
        last = at + chunk >= len(prompt)
        runner.run(SchedulerOutput((ScheduledChunk("r", part, at, pages, last, GREEDY, 0),), len(part), ()))
        assert _held_bytes(runner.states["r"].layers) <= request_bytes(kinds), at
    for position in range(len(prompt), len(prompt) + 3):
        step = ScheduledChunk("r", (7,), position, pages, True, GREEDY, position - len(prompt) + 1)
        runner.run(SchedulerOutput((step,), 1, ()))
        assert _held_bytes(runner.states["r"].layers) <= request_bytes(kinds), position


def test_a_hit_lands_on_the_last_boundary_whose_window_is_kept(sparse: tuple[Path, list[list[int]]]) -> None:
    """The pool keeps the window KV and overlap of some pages only (with a quarter: every 4th
    page of a request and the last a step completes); a prefix shared up to a page without them
    hits up to the last page before it that kept them, and the tokens are transformers' for the
    prompt."""
    model_dir, _ = sparse
    config = EngineConfig(page_size=16, v4_window_share=0.25)
    engine = ColocatedEngine.from_model_dir(model_dir, config=config)
    runner, cache = engine.runner, engine.scheduler.kv_cache
    assert isinstance(runner, V4Runner) and cache.hit_pages == runner.hit_pages
    assert runner.slots.every == 4
    first = PROMPTS[4][:130]
    engine.generate([first], GREEDY)  # its prompt's pages 0-7 in one step: slots for 3 and 7
    second = first[:120] + PROMPTS[3][:20]  # seven whole pages shared: 0-6
    [out] = engine.generate([second], GREEDY)
    assert out.cached_tokens == 4 * 16 and runner.restores == 1
    hf = hf_v4(model_dir)
    with lowest_index_ties():
        assert out.token_ids == hf_greedy(hf, second, NEW_TOKENS)
