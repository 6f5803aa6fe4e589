"""A DeepSeek-V4 request computed on one runner and continued on another, as a prefill rank hands
it to a decode rank: the prefill packs each layer's bounded state into a slot as the layer runs
(``V4Runner.run``'s ``exports``), and what is copied at that moment, the layer's pages of every
kind the request reads and its slot's span, is all the decode runner gets (``adopt``). Its
tokens are the colocated engine's (themselves transformers', ``test_v4_engine.py``), for
prompts that end inside a compression window, on one, inside the sliding window and past it,
computed in one chunk or several; the decode's first steps complete the windows the prefill
left open."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from tandem.engine.v4_runner import V4Runner
from tandem.model.kv_pool import KVPool
from tandem.model.loader import load_model
from tandem.model.v4.kv_layout import slot_bytes
from tandem.model.v4.model import DeepseekV4
from tandem.model.v4.pages import v4_pool
from tandem.model.v4.state_slots import StateSlots
from tandem.wire.request_params import SamplingParams
from tests.hf_v4_reference import write_tiny_v4

PAGE = 16
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
SEEDED = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.9, seed=7)
LENGTHS = (1, 3, 4, 7, 16, 19, 35, 131)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("handoff") / "model"
    write_tiny_v4(directory, seed=3, index_topk=3)
    return directory


def _copy_layer(src: KVPool, dst: KVPool, layer: int, src_pages: list[int], dst_pages: list[int]) -> None:
    """What a transfer of ``layer`` writes: the layer's pages of every kind it has."""
    for name in src.names:
        kind = next(k for k in src.kinds if k.name == name)
        if layer in kind.layers:
            dst.kind(name, layer)[torch.tensor(dst_pages)] = src.kind(name, layer)[torch.tensor(src_pages)]


def _handoff(
    model: DeepseekV4, prompt: list[int], sampling: SamplingParams, chunk: int, keep: bool = False
) -> list[int]:
    """The prompt on a prefill runner in chunks of ``chunk``, each layer of its last chunk
    copied to a decode runner as it completes, then decoded there; ``keep``: the decode runner
    keeps the pages it completes whole (a decode rank that writes back to a store), each page
    it completes then holds a window slot."""
    pages = -(-(len(prompt) + NEW_TOKENS) // PAGE)
    prefill_pool = v4_pool(model.cfg, 40, PAGE, model.dtype, prefix_caching=False)
    decode_pool = v4_pool(model.cfg, 40, PAGE, model.dtype, prefix_caching=keep)
    prefill_slots, decode_slots = StateSlots(model.cfg, 2, model.dtype), StateSlots(model.cfg, 3, model.dtype)
    prefill = V4Runner(model, pool=prefill_pool, state_slots=prefill_slots)
    decode = V4Runner(model, pool=decode_pool, state_slots=decode_slots, prefix_caching=keep)
    src = list(range(pages))
    dst = list(range(39, 39 - pages, -1))  # other ids, in another order
    copied: list[int] = []

    def on_layer(layer: int) -> None:
        _copy_layer(prefill_pool, decode_pool, layer, src, dst)
        offset, size = prefill_slots.spans()[layer]
        decode_slots.data[2, offset : offset + size] = prefill_slots.data[1, offset : offset + size]
        copied.append(layer)

    first = None
    for at in range(0, len(prompt), chunk):
        part = tuple(prompt[at : at + chunk])
        last = at + chunk >= len(prompt)
        plan = SchedulerOutput((ScheduledChunk("r", part, at, tuple(src), last, sampling, 0),), len(part), ())
        sampled = prefill.run(plan, on_layer if last else None, {"r": 1} if last else None)
        first = sampled.get("r", first)
    assert copied == list(range(model.cfg.num_hidden_layers))
    prefill_pool.tensors["compressed.4"].fill_(7.0)  # the prefill goes on: nothing later is read
    prefill_slots.data.fill_(3)
    assert first is not None
    decode.adopt("r", len(prompt), tuple(dst), 2)
    out = [first]
    for index in range(1, NEW_TOKENS):
        position = len(prompt) + index - 1
        step = ScheduledChunk("r", (out[-1],), position, tuple(dst), True, sampling, index)
        out.append(decode.run(SchedulerOutput((step,), 1, ()))["r"])
    completed = dst[len(prompt) // PAGE : (len(prompt) + NEW_TOKENS - 1) // PAGE]
    assert [decode.slot_of(page) is not None for page in completed] == [keep] * len(completed)
    return out


@pytest.mark.parametrize("chunk", [1000, 5])
def test_a_request_handed_over_layer_by_layer_gives_the_colocated_tokens(model_dir: Path, chunk: int) -> None:
    model = load_model(model_dir, torch.float32, "cpu")
    prompts = [[random.Random(n).randrange(256) for _ in range(n)] for n in LENGTHS]
    engine = ColocatedEngine(model, EngineConfig(page_size=PAGE))
    want = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    want_seeded = [o.token_ids for o in engine.generate(prompts[-3:], SEEDED)]
    assert [_handoff(model, p, GREEDY, chunk) for p in prompts] == want
    assert [_handoff(model, p, SEEDED, chunk) for p in prompts[-3:]] == want_seeded


def test_a_decode_runner_keeping_its_pages_gives_the_same_tokens(model_dir: Path) -> None:
    """Taken on mid-page (its open page's rows from the slot's window), a request's state goes on
    keeping pages as it decodes: the tokens do not change, and every page it completes holds
    its window KV and overlap for the write-back."""
    model = load_model(model_dir, torch.float32, "cpu")
    prompts = [[random.Random(n).randrange(256) for _ in range(n)] for n in (7, 27, 125)]
    want = [
        o.token_ids for o in ColocatedEngine(model, EngineConfig(page_size=PAGE)).generate(prompts, GREEDY)
    ]
    assert [_handoff(model, p, GREEDY, 1000, keep=True) for p in prompts] == want


def test_a_slot_holds_the_bounded_state_the_plan_counts(model_dir: Path) -> None:
    """A slot holds what ``tandem plan memory`` counts per request beside its pages: the open
    windows and last windows' projections (to 16 bytes a field), and the window's last
    ``sliding_window - 1`` tokens (which the plan counts as the whole pages they lie on)."""
    from tandem.model.v4.kv_layout import v4_kinds

    cfg = load_model(model_dir, torch.float32, "cpu").cfg
    counted = {k.kind: k.per_request for k in v4_kinds(cfg, 4, PAGE)}
    window = cfg.num_hidden_layers * (cfg.sliding_window - 1) * cfg.head_dim * 4
    fields = sum(len(StateSlots(cfg, 1, torch.float32).fields[i]) for i in range(cfg.num_hidden_layers))
    assert 0 <= slot_bytes(cfg, 4) - window - counted["open_window"] < 16 * fields
    assert window <= counted["window"]
    assert StateSlots(cfg, 3, torch.float32).data.shape == (3, slot_bytes(cfg, 4))
