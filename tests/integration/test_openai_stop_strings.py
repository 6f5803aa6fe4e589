"""Stop strings through the OpenAI API on a real deployment (Ray, NIXL, uvicorn on loopback) of
the demo model, where a chunk holds several tokens: with ``--stream-interval 8``, and with
n-gram speculation (a verify step streams every accepted token at once). A completion cut by a
stop string returns only the tokens before it: ``usage.completion_tokens`` is the number of
``logprobs.tokens``, their text is the returned text, and so are the ``token_ids``, streamed
and not, completions and chat. One server for each case, spoken to with the ``openai`` client.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import ray

from tandem.cluster.serve import ServeOptions, Server, demo_model_dir
from tandem.cluster.topology import PoolSpec, SpeculativeSpec, Topology
from tandem.frontend.limits import EdgeLimits
from tandem.model.tokenizer import Tokenizer

PAGE = 8
# the demo model learnt Genesis: it goes on with text that repeats, which lookup drafts match
PROMPT = (
    "And God said, Let there be light: and there was light. And God saw the light, that it was good. And God"
)
MAX_TOKENS = 64


@dataclass(frozen=True)
class Case:
    client: openai.OpenAI
    speculating: bool


@pytest.fixture(scope="module", params=["stream-interval-8", "ngram"])
def case(request: pytest.FixtureRequest) -> Iterator[Case]:
    pool = PoolSpec(dep=1, page_size=PAGE, num_pages=200)
    topology = Topology.preset("local").model_copy(update={"prefill": pool, "decode": pool})
    limits = EdgeLimits()
    if request.param == "ngram":
        speculative = SpeculativeSpec(tokens=5, drafter="ngram")
        topology = topology.model_copy(update={"speculative": speculative})
    else:
        limits = EdgeLimits(stream_interval=8)
    options = ServeOptions(topology, demo_model_dir(), port=0, dtype="float64", http_port=0, limits=limits)
    server = Server(options)
    try:
        server.start()
        url = f"http://{server.http_address}/v1"
        client = openai.OpenAI(base_url=url, api_key="-", max_retries=0, timeout=120)
        yield Case(client, request.param == "ngram")
    finally:
        server.stop()
        ray.shutdown()


def _model(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def _stop_in(text: str) -> str:
    """A stop string well inside ``text``, first found where it is taken from: past the first
    chunk, not at a chunk's end (so tokens of the same chunk or verify step follow it)."""
    for at in range(20, len(text) - 12):
        stop = text[at : at + 3]
        if text.find(stop) == at and stop.isascii() and stop.strip():
            return stop
    raise AssertionError(f"no stop string to take from {text!r}")


def test_a_stop_string_cuts_tokens_logprobs_and_usage_with_the_text(case: Case) -> None:
    client = case.client
    model = _model(client)
    tokenizer = Tokenizer.from_dir(demo_model_dir())
    args: dict[str, Any] = {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    extra = {"ignore_eos": True, "return_token_ids": True}
    full = client.completions.create(**args, extra_body=extra)
    assert full.usage is not None and full.usage.completion_tokens == MAX_TOKENS
    details = full.usage.completion_tokens_details
    if case.speculating:  # verify steps of several tokens happened
        assert details is not None and (details.accepted_prediction_tokens or 0) > 0, details
    text = full.choices[0].text
    stop = _stop_in(text)
    kept = text[: text.index(stop)]

    whole = client.completions.create(**args, stop=[stop], logprobs=1, extra_body=extra)
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.tokens is not None and whole.usage is not None
    ids = choice.model_extra["token_ids"]
    assert (choice.text, choice.finish_reason) == (kept, "stop")
    assert "".join(choice.logprobs.tokens) == kept == tokenizer.decode(ids)
    assert whole.usage.completion_tokens == len(choice.logprobs.tokens) == len(ids)
    assert len(choice.logprobs.token_logprobs or []) == len(ids)

    stream = client.completions.create(
        **args, stop=[stop], logprobs=1, stream=True, stream_options={"include_usage": True}, extra_body=extra
    )
    *chunks, last = list(stream)
    assert last.usage is not None
    streamed = "".join(c.choices[0].text for c in chunks)
    tokens = [t for c in chunks if c.choices[0].logprobs for t in c.choices[0].logprobs.tokens or []]
    streamed_ids = [i for c in chunks for i in c.choices[0].model_extra["token_ids"]]
    assert streamed == kept == "".join(tokens) == tokenizer.decode(streamed_ids)
    assert last.usage.completion_tokens == len(tokens) == len(streamed_ids)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_chat_stop_string_cuts_tokens_logprobs_and_usage_with_the_text(case: Case) -> None:
    client = case.client
    model = _model(client)
    messages: Any = [{"role": "user", "content": PROMPT}]
    args: dict[str, Any] = {
        "model": model,
        "messages": messages,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
    }
    full = client.chat.completions.create(**args, extra_body={"ignore_eos": True})
    text = full.choices[0].message.content or ""
    stop = _stop_in(text)
    kept = text[: text.index(stop)]

    whole = client.chat.completions.create(**args, stop=stop, logprobs=True, extra_body={"ignore_eos": True})
    choice = whole.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None and whole.usage is not None
    assert choice.message.content == kept == "".join(e.token for e in choice.logprobs.content)
    assert whole.usage.completion_tokens == len(choice.logprobs.content)

    stream = client.chat.completions.create(
        **args,
        stop=stop,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    *chunks, last = list(stream)
    assert last.usage is not None
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks)
    entries = [e for c in chunks if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert streamed == kept == "".join(e.token for e in entries)
    assert last.usage.completion_tokens == len(entries)
