"""Stop strings cut every field of a choice, not only its text, and a tool call cut by
``max_tokens`` ends as ``length`` with its text kept: the OpenAI app over a core that answers
each request with scripted chunks (no cluster), and ``StopCut`` on a tokenizer with merged
tokens.

The stop cases put a whole output in one chunk, as a speculative verify step, a stream interval
above 1 or a slow client makes it: the tokens past the stop string must not leak into
``token_ids``, ``logprobs``, ``usage.completion_tokens`` or ``best_of``'s ranking."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders
from tokenizers.models import BPE

from tandem.cluster.serve import demo_model_dir
from tandem.frontend.core import FrontendConfig, FrontendCore
from tandem.frontend.detokenizer import PairCache, StreamDetokenizer
from tandem.frontend.grpc_auth import ANONYMOUS
from tandem.frontend.openai_tools import ARGS_BEGIN, ARGS_END, CALL_BEGIN, CALL_END, CALLS_BEGIN, SEP
from tandem.frontend.request_stream import StreamChunk
from tandem.frontend.running import GenerateSpec
from tandem.frontend.stop_cut import StopCut
from tandem.model.tokenizer import Tokenizer, _byte_of_char
from tandem.wire.logprobs import TokenLogprobs
from tandem.wire.messages import Bill
from tandem.wire.request_params import FinishReason, Guide
from tandem.wire.stream_summary import StreamSummary

GENESIS = "In the beginning STOP God created the heaven"  # 44 byte tokens on the demo tokenizer
KEPT = "In the beginning "


@dataclass(frozen=True)
class Script:
    """One choice's output: its text, in chunks of ``chunk_tokens`` tokens (0: one chunk), each
    token's logprob by its index, and how the ranks end it when no stop string does."""

    text: str
    chunk_tokens: int = 0
    logprob: Callable[[int], float] = lambda i: -0.5
    finish: FinishReason = FinishReason.LENGTH


class ScriptedCore(FrontendCore):
    """The demo model's frontend, whose requests answer with a script each (choice ``i`` of a
    request for several gets ``scripts[i]``) instead of going to ranks; aborts are recorded."""

    def __init__(self, scripts: list[Script]) -> None:
        super().__init__(FrontendConfig(str(demo_model_dir()), "demo"))
        self.ready = True
        self.scripts = scripts
        self.aborted: list[str] = []

    async def check_guide(self, guide: Guide, field: str) -> None:
        return None  # a guide is the ranks' business; nothing here decodes under it

    def abort(self, request_id: str, client: str = ANONYMOUS) -> bool:
        self.aborted.append(request_id)
        return True

    async def generate(self, spec: GenerateSpec) -> AsyncGenerator[StreamChunk | StreamSummary, None]:
        parts = spec.request_id.split("-")
        script = self.scripts[int(parts[2]) if len(parts) == 3 else 0]
        ids = self.tokenizer.encode(script.text)[1:]  # no BOS
        step = script.chunk_tokens or len(ids)
        asked = spec.sampling.logprobs is not None
        detokenizer = StreamDetokenizer(self.detokenizer_cache)  # as the request's stream has it
        for start in range(0, len(ids), step):
            part = ids[start : start + step]
            entries: list[TokenLogprobs | None] | None = (
                [TokenLogprobs(t, script.logprob(start + i)) for i, t in enumerate(part)] if asked else None
            )
            yield StreamChunk(part, "".join(detokenizer.add(t) for t in part), start, logprobs=entries)
        tail = detokenizer.finish()
        if tail:
            yield StreamChunk([], tail, len(ids))
        aborted = spec.request_id in self.aborted
        finish = FinishReason.ABORT if aborted else script.finish
        bill = Bill(prompt_tokens=len(spec.prompt_token_ids), seed=spec.sampling.seed)
        yield StreamSummary(finish, None, ids, script.text, bill, None, None, None, 0.0, 0.0)


def _post(core: FrontendCore, path: str, body: dict[str, Any]) -> Any:
    """The app's answer: the JSON body, or a stream's events (without ``[DONE]``)."""
    import httpx2 as httpx

    from tandem.frontend.openai_http import build_app

    async def call() -> Any:
        transport = httpx.ASGITransport(app=build_app(core))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            reply = await client.post(path, json={"model": "demo", **body})
            assert reply.status_code == 200, reply.text
            if not body.get("stream"):
                return reply.json()
            lines = [line.removeprefix("data: ") for line in reply.text.split("\n\n") if line]
            assert lines[-1] == "[DONE]"
            return [json.loads(line) for line in lines[:-1]]

    return asyncio.run(call())


def _names(core: FrontendCore, ids: list[int]) -> str:
    return "".join(core.tokenizer.decode([i]) for i in ids)


@pytest.mark.parametrize("chunk_tokens", [0, 8, 1])
def test_a_completions_stop_string_cuts_its_tokens_logprobs_and_usage(chunk_tokens: int) -> None:
    core = ScriptedCore([Script(GENESIS, chunk_tokens)])
    body = {"prompt": "Genesis", "max_tokens": 60, "stop": ["STOP"], "logprobs": 0, "return_token_ids": True}
    whole = _post(core, "/v1/completions", body)
    choice = whole["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == (KEPT, "stop")
    assert "".join(choice["logprobs"]["tokens"]) == KEPT == _names(core, choice["token_ids"])
    assert len(choice["token_ids"]) == len(KEPT) == whole["usage"]["completion_tokens"]
    assert len(choice["logprobs"]["token_logprobs"]) == len(choice["logprobs"]["top_logprobs"]) == len(KEPT)
    assert choice["logprobs"]["text_offset"] == list(range(len(KEPT)))

    events = _post(
        core, "/v1/completions", {**body, "stream": True, "stream_options": {"include_usage": True}}
    )
    *chunks, used = events
    text = "".join(e["choices"][0]["text"] for e in chunks)
    tokens = [t for e in chunks if e["choices"][0]["logprobs"] for t in e["choices"][0]["logprobs"]["tokens"]]
    ids = [i for e in chunks for i in e["choices"][0]["token_ids"]]
    offsets = [
        o for e in chunks if e["choices"][0]["logprobs"] for o in e["choices"][0]["logprobs"]["text_offset"]
    ]
    assert text == KEPT == "".join(tokens) == _names(core, ids)
    assert used["usage"]["completion_tokens"] == len(tokens) == len(ids) == len(KEPT)
    assert offsets == list(range(len(KEPT)))
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"


def test_a_chat_stop_string_cuts_its_tokens_logprobs_and_usage() -> None:
    core = ScriptedCore([Script(GENESIS)])
    messages = [{"role": "user", "content": "Genesis?"}]
    body = {
        "messages": messages,
        "max_tokens": 60,
        "stop": "STOP",
        "logprobs": True,
        "return_token_ids": True,
    }
    whole = _post(core, "/v1/chat/completions", body)
    choice = whole["choices"][0]
    entries = choice["logprobs"]["content"]
    assert choice["message"]["content"] == KEPT == "".join(e["token"] for e in entries)
    assert whole["usage"]["completion_tokens"] == len(entries) == len(choice["token_ids"]) == len(KEPT)

    stream = {
        **body,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    *chunks, used = _post(core, "/v1/chat/completions", stream)
    text = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
    entries = [
        x for e in chunks if e["choices"][0]["logprobs"] for x in e["choices"][0]["logprobs"]["content"]
    ]
    assert text == KEPT == "".join(e["token"] for e in entries)
    assert used["usage"]["completion_tokens"] == len(entries) == len(KEPT)
    assert chunks[-1]["usage"]["completion_tokens"] == len(KEPT)  # the running count, too


def test_best_of_ranks_choices_by_the_tokens_before_the_stop_string() -> None:
    """Choice 0's tokens before the stop are likelier than choice 1's, its tokens after it far
    less likely: cut at the stop, choice 0 wins; summed over the whole chunk it would lose."""
    past = len(KEPT)
    likely_then_not = Script(GENESIS, logprob=lambda i: -0.1 if i < past else -5.0)
    steady = Script("In the end the heaven and the earth", logprob=lambda i: -0.3)
    core = ScriptedCore([likely_then_not, steady])
    body = {"prompt": "Genesis", "max_tokens": 60, "stop": ["STOP"], "best_of": 2, "n": 1}
    whole = _post(core, "/v1/completions", body)
    assert [c["text"] for c in whole["choices"]] == [KEPT]
    assert whole["usage"]["completion_tokens"] == len(KEPT) + len(steady.text)  # both candidates', cut

    both = _post(
        core,
        "/v1/completions",
        {**{k: v for k, v in body.items() if k != "best_of"}, "n": 2, "logprobs": 0, "stream": True},
    )
    by_choice: dict[int, list[str]] = {0: [], 1: []}
    texts: dict[int, str] = {0: "", 1: ""}
    for event in both:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["text"]
            by_choice[choice["index"]] += (choice["logprobs"] or {}).get("tokens", [])
    assert texts == {0: KEPT, 1: steady.text}
    assert {i: "".join(t) for i, t in by_choice.items()} == texts


def test_a_cut_tool_call_ends_as_length_with_its_text_kept() -> None:
    """``tool_choice: required`` and ``max_tokens`` ending the output in the middle of a second
    call: one complete call, ``finish_reason: length`` and the partial call's text as content."""
    first = f'{CALL_BEGIN}function{SEP}get_weather{ARGS_BEGIN}{{"city": "Paris"}}{ARGS_END}{CALL_END}'
    partial = f'\n{CALL_BEGIN}function{SEP}get_weather{ARGS_BEGIN}{{"ci'
    core = ScriptedCore([Script(CALLS_BEGIN + first + partial, chunk_tokens=5)])
    tool = {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    body = {"messages": [{"role": "user", "content": "Weather?"}], "tools": [tool], "tool_choice": "required"}
    whole = _post(core, "/v1/chat/completions", {**body, "max_tokens": 200})
    choice = whole["choices"][0]
    assert choice["finish_reason"] == "length"
    assert [c["function"]["arguments"] for c in choice["message"]["tool_calls"]] == ['{"city": "Paris"}']
    assert choice["message"]["content"] == partial  # the unparsed call, not dropped

    *chunks, _ = _post(core, "/v1/chat/completions", {**body, "max_tokens": 200, "stream": True,
                                                      "stream_options": {"include_usage": True}})  # fmt: skip
    content = "".join(e["choices"][0]["delta"].get("content") or "" for e in chunks)
    calls = [c for e in chunks for c in e["choices"][0]["delta"].get("tool_calls") or []]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert content == partial
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"

    ended = ScriptedCore([Script(CALLS_BEGIN + first + "<｜tool▁calls▁end｜>", finish=FinishReason.STOP)])
    assert _post(ended, "/v1/chat/completions", body)["choices"][0]["finish_reason"] == "tool_calls"


# ---- StopCut on its own, with tokens of several characters --------------------------------
@pytest.fixture(scope="module")
def merged(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    """A byte-level BPE tokenizer whose ids 256.. are whole words (no merges: only decoded)."""
    char_of = {b: c for c, b in _byte_of_char().items()}
    vocab = {char_of[b]: b for b in range(256)}
    for word in ("In", " the", " beginning", " ", " ST", "OP", "STOP", " God", "é"):
        vocab.setdefault("".join(char_of[b] for b in word.encode()), len(vocab))
    backend = HFTokenizer(BPE(vocab, []))
    backend.decoder = decoders.ByteLevel()
    return Tokenizer(backend, None, None)


def _ids(tokenizer: Tokenizer, *pieces: str) -> list[int]:
    char_of = {b: c for c, b in _byte_of_char().items()}
    found = [tokenizer.token_to_id("".join(char_of[b] for b in p.encode())) for p in pieces]
    assert None not in found, pieces
    return [i for i in found if i is not None]


def _cut_all(cut: StopCut, chunks: list[list[int]]) -> tuple[str, list[int], bool]:
    """Every chunk through ``cut``, then its end: the text and tokens it let out, and whether a
    stop string was found."""
    text, ids = "", list[int]()
    for chunk in chunks:
        out = cut.feed(chunk, "", [TokenLogprobs(t, -1.0) for t in chunk])
        assert len(out.logprobs) == len(out.token_ids)
        text, ids = text + out.text, ids + out.token_ids
    out = cut.finish()
    return text + out.text, ids + out.token_ids, cut.stopped


def test_stop_cut_keeps_the_tokens_that_end_before_the_stop(merged: Tokenizer) -> None:
    cache = PairCache(merged)
    apart = _ids(merged, "In", " the", " beginning", " ", "STOP", " God")
    straddling = _ids(merged, "In", " the", " beginning", " ST", "OP", " God")
    for ids, kept in ((apart, "In the beginning "), (straddling, "In the beginning")):
        for size in (1, 2, len(ids)):
            chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
            text, out, stopped = _cut_all(StopCut(["STOP"], cache), chunks)
            assert stopped and text == kept == merged.decode(out), (size, text)
    # nothing found: every token, nothing held back; a stop later in the stream than a prefix of it
    text, out, stopped = _cut_all(StopCut(["STOPS"], cache), [straddling[:4], straddling[4:]])
    assert not stopped and out == straddling and text == merged.decode(straddling)


def test_stop_cut_holds_a_characters_first_bytes_with_it(merged: Tokenizer) -> None:
    """``é`` is two byte tokens; the first completes no text and goes (or is dropped) with the second."""
    cache = PairCache(merged)
    e_bytes = list("é".encode())  # byte tokens' ids are the bytes
    ids = _ids(merged, "In") + e_bytes + _ids(merged, " God")
    text, out, stopped = _cut_all(StopCut(["é"], cache), [ids[:2], ids[2:]])
    assert stopped and (text, out) == ("In", ids[:1])
    cut = StopCut(["God"], cache)
    first = cut.feed(ids[:2], "", None)  # "In" and the first byte of é
    assert (first.text, first.token_ids, first.logprobs) == ("In", ids[:1], [None])
    text, out, stopped = _cut_all(cut, [ids[2:]])
    assert stopped and (text, out) == ("é", ids[1:3])  # " God" holds the stop's start: dropped
    # an output that ends inside a character: its bytes go at the end, as U+FFFD
    text, out, stopped = _cut_all(StopCut(["x"], cache), [ids[:2]])
    assert not stopped and out == ids[:2] and text == "In\ufffd"


def test_stop_cut_keeps_bytes_that_never_complete_a_character_before_the_stop(merged: Tokenizer) -> None:
    """Two bytes that are no UTF-8 come out as U+FFFD only with the next token's text; when that
    token begins the stop string, the bytes are kept with their U+FFFD text (OpenAI's cut)."""
    cache = PairCache(merged)
    ids = [*_ids(merged, "In"), 0xFF, 0xFE, *_ids(merged, "STOP", " God")]
    for size in (1, 2, len(ids)):
        chunks = [ids[i : i + size] for i in range(0, len(ids), size)]
        text, out, stopped = _cut_all(StopCut(["STOP"], cache), chunks)
        assert stopped and text == "In\ufffd\ufffd" == merged.decode(out) and out == ids[:3], size
    # a token of its own text across the stop's start still goes whole, the byte before it not
    ids = [*_ids(merged, "In"), 0xFF, *_ids(merged, " ST", "OP")]
    text, out, stopped = _cut_all(StopCut(["STOP"], cache), [ids])
    assert stopped and (text, out) == ("In\ufffd", ids[:2])
