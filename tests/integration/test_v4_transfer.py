"""A DeepSeek-V4 request through two real NIXL transports in one process (no Ray), as a prefill
rank hands it to a decode rank: each layer's writes are posted from inside the forward, as the
layer runs (its pages of every kind the request reads, and its span of the request's slot of
bounded state); the decode runner adopts what landed and decodes the colocated engine's tokens.
The bytes the transfer reports are the layout's: the prompt's pages of each kind and one slot."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from tandem.engine.v4_runner import V4Runner
from tandem.kvtransfer.metadata import InMemoryMetadataStore
from tandem.kvtransfer.nixl_transport import NixlTransport
from tandem.kvtransfer.transport import ReceivedKV
from tandem.kvtransfer.types import KVDestination, KVNotification, KVTransferError
from tandem.model.loader import load_model
from tandem.model.v4.model import DeepseekV4
from tandem.model.v4.pages import transfer_layout, v4_pool
from tandem.model.v4.state_slots import StateSlots
from tandem.wire.request_params import SamplingParams
from tests.hf_v4_reference import write_tiny_v4
from tests.kvtransfer.transfer_doubles import wait_until

PAGE, NEW_TOKENS = 16, 10
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)


@dataclass
class _Side:
    runner: V4Runner
    slots: StateSlots
    transport: NixlTransport


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> DeepseekV4:
    directory: Path = tmp_path_factory.mktemp("v4transfer") / "model"
    write_tiny_v4(directory, seed=3, index_topk=3)
    loaded = load_model(directory, torch.float32, "cpu")
    assert isinstance(loaded, DeepseekV4)
    return loaded


@pytest.fixture
def sides(model: DeepseekV4) -> Iterator[tuple[_Side, _Side]]:
    store = InMemoryMetadataStore()
    made = []
    for name, pages, slots in (("prefill-0", 24, 2), ("decode-0", 40, 3)):
        pool = v4_pool(model.cfg, pages, PAGE, model.dtype, prefix_caching=False)
        state = StateSlots(model.cfg, slots, model.dtype)
        transport = NixlTransport(name, 1, transfer_layout(pool, state), store)
        made.append(_Side(V4Runner(model, pool=pool, state_slots=state), state, transport))
    yield made[0], made[1]
    for side in made:
        side.transport.close()


def _transfer(prefill: _Side, decode: _Side, prompt: list[int]) -> tuple[int, ReceivedKV, list[int]]:
    pages = -(-(len(prompt) + NEW_TOKENS) // PAGE)
    src, dst = tuple(range(1, pages + 1)), tuple(range(39, 39 - pages, -1))
    decode.transport.expect("r", "prefill-0", dst, 30.0)
    prefill.transport.begin_send("r", KVDestination("decode-0", 1, dst, state_slot=2), src, 30.0, src_slot=1)
    posted: list[int] = []

    def on_layer(layer: int) -> None:
        prefill.transport.send_layer("r", layer)
        posted.append(layer)

    plan = SchedulerOutput((ScheduledChunk("r", tuple(prompt), 0, src, True, GREEDY, 0),), len(prompt), ())
    first = prefill.runner.run(plan, on_layer, {"r": 1})["r"]
    prefill.transport.finish_send("r", KVNotification("r", first, 0), 0.0)
    received: list[ReceivedKV] = []

    def poll() -> None:
        received.extend(decode.transport.poll().received)
        prefill.transport.poll()

    wait_until(lambda: bool(received), step=poll)
    return first, received[0], posted


def test_a_v4_request_crosses_nixl_layer_by_layer_and_decodes_the_colocated_tokens(
    model: DeepseekV4, sides: tuple[_Side, _Side]
) -> None:
    prefill, decode = sides
    prompt = [random.Random(131).randrange(256) for _ in range(131)]
    want = ColocatedEngine(model, EngineConfig(page_size=PAGE)).generate([prompt], GREEDY)[0].token_ids
    first, got, posted = _transfer(prefill, decode, prompt)
    assert posted == list(range(model.cfg.num_hidden_layers))
    # what crossed: every page the prompt's entries lie on, of each kind, and one slot
    layout = prefill.transport.layout
    pages = -(-(len(prompt) + NEW_TOKENS) // PAGE)
    expected = sum(
        pages * sum(region.layer_bytes) if not region.slots else sum(region.layer_bytes)
        for region in layout.regions
    )
    assert got.notification.kv_bytes == got.stats.bytes == expected
    assert {r.name for r in layout.regions} == {"compressed.4", "compressed.16", "indexer_keys", "state"}
    decode.runner.adopt("r", len(prompt), tuple(range(39, 39 - pages, -1)), 2)
    out = [first]
    for index in range(1, NEW_TOKENS):
        position = len(prompt) + index - 1
        step = ScheduledChunk(
            "r", (out[-1],), position, tuple(range(39, 39 - pages, -1)), True, GREEDY, index
        )
        out.append(decode.runner.run(SchedulerOutput((step,), 1, ()))["r"])
    assert out == want


def test_a_send_without_a_slot_is_refused_by_name(sides: tuple[_Side, _Side]) -> None:
    prefill, _ = sides
    with pytest.raises(KVTransferError, match="write a slot of state: none was given"):
        prefill.transport.begin_send("x", KVDestination("decode-0", 1, (1,)), (2,), 5.0)
