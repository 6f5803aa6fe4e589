"""DeepSeek-V4's MTP drafts across a prefill/decode handoff, without Ray: a prefill runner
(``mtp_prefill``) runs the prompt's rows through the MTP layer too and packs that layer's state
as the slot's last layer; a decode runner adopts the request and its drafter starts from that
state and the prompt's last streams. Every step's drafts are exactly what the MTP layer gives
over the whole sequence computed in one call (its state crossed intact, the chained passes put
back), and the tokens are the colocated engine's, greedy and seeded, K = 1 and 3."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.request import Request
from tandem.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from tandem.engine.speculation import SpeculativeConfig
from tandem.engine.v4_mtp_drafter import V4MtpDrafter
from tandem.engine.v4_runner import V4Runner
from tandem.model.loader import load_model
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.model.v4.attention import LayerState
from tandem.model.v4.model import DeepseekV4
from tandem.model.v4.pages import v4_pool
from tandem.model.v4.state_slots import StateSlots
from tandem.wire.request_params import SamplingParams

PAGE = 16
NEW_TOKENS = 10


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> DeepseekV4:
    out = tmp_path_factory.mktemp("v4mtp") / "model"
    make_tiny_checkpoint(out, seed=5, arch="deepseek_v4", num_nextn_predict_layers=1, index_topk=3)
    loaded = load_model(out, torch.float64, "cpu", mtp=True)
    assert isinstance(loaded, DeepseekV4)
    return loaded


def _reference_drafts(model: DeepseekV4, tokens: list[int], k: int, cold: int = 0) -> list[int]:
    """Greedy drafts after ``tokens`` from one forward over all of them and one MTP call over
    every known row from ``cold`` on (a window started there), then the chain."""
    q = len(tokens) - 1
    ids = torch.tensor(tokens)
    streams = model.forward(
        ids, torch.arange(len(tokens)), [len(tokens)], [model.new_state()], before_head=True
    )
    state = LayerState()
    hidden, out = model.draft(streams[cold:q], ids[cold + 1 :], torch.arange(cold, q), [q - cold], [state])
    hidden, out = hidden[-1:], out[-1:]
    drafts: list[int] = []
    for j in range(k):
        if j:
            hidden, out = model.draft(out, torch.tensor(drafts[-1:]), torch.tensor([q + j - 1]), [1], [state])
        drafts.append(int(model.compute_logits(hidden).argmax(-1)))
    return drafts


Steps = list[tuple[list[int], tuple[int, ...]]]


def _serve(
    model: DeepseekV4, prompt: list[int], sampling: SamplingParams, k: int, chunk: int, cached: int = 0
) -> tuple[list[int], Steps]:
    """The prompt prefilled in chunks of ``chunk`` and handed over layer by layer (the MTP layer
    last), then decoded with K drafts a step; the tokens, and each step's (known tokens, drafts).
    ``cached``: its first tokens are a prefix hit on the prefill rank (another request computed
    them, and the prompt starts there, its state restored from their pages)."""
    pages = -(-(len(prompt) + NEW_TOKENS + k) // PAGE)
    prefill_pool = v4_pool(model.cfg, 40, PAGE, model.dtype, prefix_caching=cached > 0)
    decode_pool = v4_pool(model.cfg, 40, PAGE, model.dtype, prefix_caching=False)
    prefill_slots = StateSlots(model.cfg, 2, model.dtype, mtp=True)
    decode_slots = StateSlots(model.cfg, 3, model.dtype, mtp=True)
    prefill = V4Runner(
        model, pool=prefill_pool, state_slots=prefill_slots, mtp_prefill=True, prefix_caching=cached > 0
    )
    decode = V4Runner(model, pool=decode_pool, state_slots=decode_slots, keep_hidden=True, speculative=True)
    drafter = V4MtpDrafter(SpeculativeConfig(num_tokens=k, drafter="mtp"), model=model, runner=decode)
    src, dst = list(range(pages)), list(range(39, 39 - pages, -1))
    copied: list[int] = []

    def on_layer(layer: int) -> None:
        for name in decode_pool.names:  # what a transfer writes: the kinds a running request reads
            if layer in next(kind for kind in prefill_pool.kinds if kind.name == name).layers:
                decode_pool.kind(name, layer)[torch.tensor(dst)] = prefill_pool.kind(name, layer)[
                    torch.tensor(src)
                ]
        offset, size = prefill_slots.spans()[layer]
        decode_slots.data[2, offset : offset + size] = prefill_slots.data[1, offset : offset + size]
        copied.append(layer)

    if cached:  # another request fills the pages of the shared prefix
        other = (*prompt[:cached], 9, 9, 9)
        warm = ScheduledChunk("w", other, 0, tuple(src), True, sampling, 0)
        prefill.run(SchedulerOutput((warm,), len(other), ()))
        prefill.forget("w")
    first = None
    for at in range(cached, len(prompt), chunk):
        part = tuple(prompt[at : at + chunk])
        last = at + chunk >= len(prompt)
        following = None if last else prompt[at + chunk]
        step = ScheduledChunk("r", part, at, tuple(src), last, sampling, 0, next_token_id=following)
        sampled = prefill.run(
            SchedulerOutput((step,), len(part), ()), on_layer if last else None, {"r": 1} if last else None
        )
        first = sampled.get("r", first)
    assert copied == list(range(model.cfg.num_hidden_layers + 1))  # the MTP layer's slot span last
    assert prefill.restores == int(cached > 0)
    hidden = prefill.hidden_state("r")
    prefill_slots.data.fill_(3)  # the prefill goes on: nothing later is read
    assert first is not None
    decode.adopt("r", len(prompt), tuple(dst), 2)
    drafter.start("r", hidden)
    request = Request("r", list(prompt), sampling, output_token_ids=[first])
    steps = []
    while len(request.output_token_ids) < NEW_TOKENS:
        drafts = drafter.propose([request], {"r": k})["r"]
        steps.append((list(request.all_token_ids), drafts))
        position = request.num_tokens - 1
        tokens = (request.output_token_ids[-1], *drafts)
        verify = ScheduledChunk(
            "r", tokens, position, tuple(dst), True, sampling, len(request.output_token_ids), drafts
        )
        given = decode.verify(SchedulerOutput((verify,), len(tokens), ()))["r"]
        request.output_token_ids.extend(given)
        drafter.observe("r", given, decode.hidden_rows("r", len(given)))
    return request.output_token_ids[:NEW_TOKENS], steps


@pytest.mark.parametrize(("k", "chunk"), [(1, 1000), (3, 1000), (3, 5)])
def test_mtp_drafts_after_a_handoff_are_the_layers_own_and_the_tokens_plain_decodings(
    model: DeepseekV4, k: int, chunk: int
) -> None:
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    seeded = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, temperature=0.9, seed=7)
    prompts = [[random.Random(n).randrange(256) for _ in range(n)] for n in (1, 6, 19, 70)]
    engine = ColocatedEngine(model, EngineConfig(page_size=PAGE))
    want = [o.token_ids for o in engine.generate(prompts, [greedy] * len(prompts))]
    want_seeded = [o.token_ids for o in engine.generate(prompts, [seeded] * len(prompts))]
    drafted = 0
    for prompt, tokens, seeded_tokens in zip(prompts, want, want_seeded, strict=True):
        got, steps = _serve(model, prompt, greedy, k, chunk)
        assert got == tokens
        for known, drafts in steps:
            assert list(drafts) == _reference_drafts(model, known, k)
            drafted += len(drafts)
        assert _serve(model, prompt, seeded, k, chunk)[0] == seeded_tokens
    assert drafted > 0


def test_a_request_whose_prefill_kept_no_mtp_state_drafts_nothing(model: DeepseekV4) -> None:
    """The streams come only with an MTP state in the slot: without them the drafter leaves the
    request out (it decodes one token a step), and it asks nothing of the runner later."""
    decode = V4Runner(model, state_slots=StateSlots(model.cfg, 1, model.dtype, mtp=True), keep_hidden=True)
    drafter = V4MtpDrafter(SpeculativeConfig(num_tokens=2, drafter="mtp"), model=model, runner=decode)
    drafter.start("r", b"")
    request = Request("r", [5, 6, 7], SamplingParams(max_tokens=4), output_token_ids=[8])
    assert drafter.propose([request], {"r": 2}) == {}


def test_a_prefill_from_a_prefix_hit_drafts_from_a_window_started_at_the_hit(model: DeepseekV4) -> None:
    """The hit's pages keep no MTP state: the prefill starts the MTP window there, the row count
    crosses with the streams, and the decode rank's drafts are the layer's over that window
    (exactly); the tokens are plain decoding's whatever the drafts."""
    greedy = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    rng = random.Random(3)
    prompts = [[rng.randrange(256) for _ in range(n)] for n in (33, 45, 70)]
    engine = ColocatedEngine(model, EngineConfig(page_size=PAGE))
    want = [o.token_ids for o in engine.generate(prompts, [greedy] * len(prompts))]
    for prompt, tokens in zip(prompts, want, strict=True):
        got, steps = _serve(model, prompt, greedy, 3, 1000, cached=32)
        assert got == tokens
        assert steps and all(list(d) == _reference_drafts(model, known, 3, cold=32) for known, d in steps)
