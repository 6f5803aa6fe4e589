"""The OpenAI edge without Ray: requests to GenerateSpec (the gRPC edge's tokenisation and
sampling), refusals in OpenAI's error shape naming the field, stop strings on streamed text, the
chat template against Hugging Face's rendering, and the app's errors over HTTP (no cluster: the
frontend is not ready)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tandem.frontend.chat_template import ChatTemplate, ChatTemplateError
from tandem.frontend.core import FrontendConfig, FrontendCore
from tandem.frontend.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    ServedModel,
    parse_request,
    prepare_chat,
    prepare_completion,
)
from tandem.frontend.openai_shapes import ResponseShape, cached_within, usage
from tandem.model.make_tiny import BOS_ID, write_tokenizer
from tandem.model.tokenizer import Tokenizer
from tandem.wire.messages import Bill, CachedByTier, Speculation
from tandem.wire.request_params import SamplingParams

CONTEXT = 2048


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tok")
    write_tokenizer(out)
    return out


@pytest.fixture(scope="module")
def model(tokenizer_dir: Path) -> ServedModel:
    tokenizer = Tokenizer.from_dir(tokenizer_dir)
    return ServedModel("tiny", tokenizer, 258, CONTEXT, ChatTemplate.from_dir(tokenizer_dir))


def _completion(served: ServedModel, **body: Any) -> Any:
    request = parse_request(CompletionRequest, {"model": "tiny", "prompt": "Hello", **body})
    return prepare_completion(request, served, "cmpl-1", "alice", 5.0)


def _refused(call: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        call()
    return info.value


def test_a_text_prompt_is_tokenised_as_the_grpc_edge_does_with_its_sampling(model: ServedModel) -> None:
    prepared = _completion(
        model,
        max_tokens=7,
        temperature=0.7,
        top_p=0.9,
        seed=11,
        stop_token_ids=[10, 10, 12],
        ignore_eos=True,
        top_k=5,
        user="someone",
    )
    spec = prepared.spec
    assert spec.prompt_token_ids == model.tokenizer.encode("Hello") == [BOS_ID, *b"Hello"]
    assert spec.sampling == SamplingParams(
        max_tokens=7, temperature=0.7, top_p=0.9, top_k=5, seed=11, stop_token_ids=(10, 12), ignore_eos=True
    )
    assert (spec.request_id, spec.client, spec.arrival_s) == ("cmpl-1", "alice", 5.0)
    assert not prepared.stream and prepared.stop == ()


def test_openai_defaults_token_id_prompts_and_one_prompt_in_a_list(model: ServedModel) -> None:
    spec = _completion(model).spec
    assert spec.sampling == SamplingParams(max_tokens=16, temperature=1.0)  # OpenAI's defaults
    assert _completion(model, prompt=[5, 6, 7]).spec.prompt_token_ids == [5, 6, 7]
    assert _completion(model, prompt=[[5, 6]]).spec.prompt_token_ids == [5, 6]
    assert _completion(model, prompt=["Hi"]).spec.prompt_token_ids == [BOS_ID, *b"Hi"]
    assert _completion(model, max_completion_tokens=3).spec.sampling.max_tokens == 3
    prepared = _completion(model, stream=True, stream_options={"include_usage": True}, stop=["a", "bc", "a"])
    assert prepared.stream and prepared.include_usage and prepared.stop == ("a", "bc")


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"n": 17}, "n", 400),
        ({"n": 0}, "n", 400),
        ({"n": 2, "best_of": 1}, "best_of", 400),
        ({"best_of": 2, "stream": True}, "best_of", 400),
        ({"model": "gpt-4"}, "model", 404),
        ({"max_tokens": 0}, "max_tokens", 400),
        ({"max_tokens": "5"}, "max_tokens", 400),
        ({"max_completion_tokens": -1}, "max_completion_tokens", 400),
        ({"max_tokens": 3000}, "max_tokens", 400),
        ({"max_tokens": 3, "max_completion_tokens": 4}, "max_completion_tokens", 400),
        ({"temperature": -1}, "temperature", 400),
        ({"top_p": 0}, "top_p", 400),
        ({"seed": -1}, "seed", 400),
        ({"logprobs": 21}, "logprobs", 400),
        ({"logprobs": True}, "logprobs", 400),
        ({"logprobs": -1}, "logprobs", 400),
        ({"best_of": 17}, "best_of", 400),
        ({"echo": "yes"}, "echo", 400),
        ({"logit_bias": {"300": 10}}, "logit_bias", 400),
        ({"logit_bias": {"5": 101}}, "logit_bias", 400),
        ({"logit_bias": {"x": 1}}, "logit_bias", 400),
        ({"frequency_penalty": 2.5}, "frequency_penalty", 400),
        ({"presence_penalty": "1"}, "presence_penalty", 400),
        ({"repetition_penalty": 0}, "repetition_penalty", 400),
        ({"min_p": 1.5}, "min_p", 400),
        ({"tools": [{"type": "function"}]}, "tools", 400),
        ({"made_up": 1}, "made_up", 400),
        ({"prompt": ["a", "b"]}, "prompt", 400),
        ({"prompt": ""}, "prompt", 400),
        ({"prompt": []}, "prompt", 400),
        ({"prompt": [300]}, "prompt", 400),
        ({"prompt": [1] * CONTEXT}, "prompt", 400),
        ({"stop": [""]}, "stop", 400),
        ({"stop_token_ids": [999]}, "stop_token_ids", 400),
        ({"stream_options": {"include_usage": True}}, "stream_options", 400),
        ({"stream": True, "stream_options": {"made_up": True}}, "stream_options.made_up", 400),
        ({"stream": True, "stream_options": {"str": True}}, "stream_options.str", 400),
        ({"stream": True, "stream_options": {"continuous_usage_stats": 1}}, "stream_options", 400),
        ({"store": "yes"}, "store", 400),
        ({"metadata": {"k": 1}}, "metadata", 400),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata", 400),
        ({"metadata": {"k" * 65: "v"}}, "metadata", 400),
        ({"metadata": {"k": "v" * 513}}, "metadata.k", 400),
        ({"service_tier": "turbo"}, "service_tier", 400),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls", 400),
    ],
)
def test_bad_fields_are_refused_naming_them(
    model: ServedModel, body: dict[str, Any], param: str, status: int
) -> None:
    error = _refused(lambda: _completion(model, **body))
    assert (error.status, error.param) == (status, param)
    shape = error.body()["error"]
    assert set(shape) == {"message", "type", "param", "code"} and shape["param"] == param
    assert shape["type"] == "invalid_request_error" and shape["message"]
    if status == 404:
        assert shape["code"] == "model_not_found"


def test_off_values_of_unsupported_fields_pass(model: ServedModel) -> None:
    prepared = _completion(model, logprobs=None, echo=False, best_of=1, frequency_penalty=0, logit_bias={})
    assert prepared.spec.sampling.max_tokens == 16


def test_fields_that_do_not_change_the_output_are_accepted_and_change_nothing(model: ServedModel) -> None:
    """``store``, ``metadata``, ``service_tier``, ``user`` and ``parallel_tool_calls``, as the
    official client and agent frameworks send them: the same spec as without them."""
    plain = _completion(model, seed=3)
    dressed = _completion(
        model,
        seed=3,
        store=True,
        metadata={"team": "eval", "run": "7"},
        service_tier="auto",
        user="alice@example.com",
        parallel_tool_calls=False,
    )
    assert dressed.spec == plain.spec
    streamed = _completion(
        model, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True}
    )
    assert streamed.include_usage and streamed.continuous_usage
    assert not _completion(model, stream=True, stream_options={"include_usage": True}).continuous_usage


def test_logprobs_and_echo_become_the_specs_sampling(model: ServedModel) -> None:
    """Completions' ``logprobs: k`` asks for k alternatives of each output token, and with
    ``echo`` of each prompt token; ``max_tokens: 0`` with ``echo`` computes one token and returns
    none. Chat's ``logprobs: true`` with ``top_logprobs: k``; ``top_logprobs`` alone is refused."""
    assert _completion(model).spec.sampling.logprobs is None  # nothing asked: nothing computed
    plain = _completion(model, logprobs=2)
    assert (plain.spec.sampling.logprobs, plain.spec.sampling.prompt_logprobs, plain.echo) == (2, None, None)
    echoed = _completion(model, prompt=[5, 6, 7], logprobs=1, echo=True, max_tokens=0)
    assert echoed.spec.sampling.prompt_logprobs == 1 and echoed.prompt_only
    assert echoed.spec.sampling.max_tokens == 1 and echoed.echo == model.tokenizer.decode([5, 6, 7])
    text = _completion(model, prompt="Hello", echo=True)
    assert text.echo == "Hello" and text.spec.sampling.prompt_logprobs is None and not text.prompt_only

    def chat(**fields: Any) -> Any:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}], **fields}
        return prepare_chat(parse_request(ChatRequest, body), model, "chat-1", room_tokens=100)

    assert chat(logprobs=True, top_logprobs=3).spec.sampling.logprobs == 3
    assert chat(logprobs=True).spec.sampling.logprobs == 0
    assert chat(logprobs=False).spec.sampling.logprobs is None
    assert _refused(lambda: chat(top_logprobs=2)).param == "top_logprobs"
    assert _refused(lambda: chat(logprobs=True, top_logprobs=21)).param == "top_logprobs"
    assert _refused(lambda: chat(echo=True)).param == "echo"


def test_logprobs_in_openais_two_shapes() -> None:
    """Completions: the token's own entry joins its k likeliest, an echoed prompt's first token
    has none, offsets count the token names; chat: the k likeliest. A token that is part of a
    UTF-8 character is named by its bytes."""
    from tandem.frontend.openai_logprobs import TokenNames, chat_logprobs, completion_logprobs
    from tandem.wire.logprobs import TokenLogprobs

    class Bytes:
        def token_bytes(self, token: int) -> bytes:
            return bytes([token])

    names = TokenNames(Bytes())  # type: ignore[arg-type]
    a, b = TokenLogprobs(ord("b"), -0.5, ((ord("c"), -0.25),)), TokenLogprobs(0xE4, -2.0, ())
    body = completion_logprobs(names, [ord("a"), ord("b"), 0xE4], [None, a, b], 3)
    assert body == {
        "tokens": ["a", "b", "bytes:\\xe4"],
        "token_logprobs": [None, -0.5, -2.0],
        "top_logprobs": [None, {"c": -0.25, "b": -0.5}, {"bytes:\\xe4": -2.0}],
        "text_offset": [3, 4, 5],
    }
    (entry,) = chat_logprobs(names, [ord("b")], [a])["content"]
    assert entry == {
        "token": "b",
        "logprob": -0.5,
        "bytes": [ord("b")],
        "top_logprobs": [{"token": "c", "logprob": -0.25, "bytes": [ord("c")]}],
    }


def test_a_body_that_is_not_an_object_is_refused() -> None:
    error = _refused(lambda: parse_request(CompletionRequest, [1, 2]))
    assert error.status == 400 and error.param is None


def test_chat_renders_the_template_and_defaults_to_the_room_left(model: ServedModel) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
    ]
    request = parse_request(ChatRequest, {"model": "tiny", "messages": messages, "seed": 3})
    prepared = prepare_chat(request, model, "chat-1", room_tokens=1000)
    text = "Be brief.<｜User｜>Hi<｜Assistant｜>"
    assert prepared.spec.prompt_token_ids == [BOS_ID, *text.encode()]  # one BOS, the template's
    assert prepared.spec.sampling.max_tokens == 1000 - len(prepared.spec.prompt_token_ids)
    assert prepared.spec.sampling.seed == 3


def test_chat_refusals_name_the_message(model: ServedModel, tokenizer_dir: Path) -> None:
    def chat(messages: Any, served: ServedModel = model) -> Any:
        request = parse_request(ChatRequest, {"model": "tiny", "messages": messages})
        return prepare_chat(request, served, "chat-1")

    assert _refused(lambda: chat([])).param == "messages"
    assert _refused(lambda: chat([{"role": "wizard", "content": "x"}])).param == "messages.0.role"
    image = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]
    assert _refused(lambda: chat(image)).param == "messages.0.content.0.image_url"  # not a text part
    assert _refused(lambda: chat([{"role": "user", "content": 5}])).param == "messages.0.content"
    made_up = _refused(lambda: chat([{"role": "user", "content": "x", "made_up": 1}]))
    assert made_up.param == "messages.0.made_up" and "unknown field" in made_up.message
    part = [{"role": "user", "content": [{"type": "text", "text": "x", "made_up": 1}]}]
    assert _refused(lambda: chat(part)).param == "messages.0.content.0.made_up"
    no_template = ServedModel("tiny", model.tokenizer, 258, CONTEXT, None)
    error = _refused(lambda: chat([{"role": "user", "content": "x"}], no_template))
    assert error.param == "messages" and "no chat template" in error.message


def test_the_chat_template_renders_as_hugging_face_does(model: ServedModel, tokenizer_dir: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_dir))
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "And 3+3?"},
    ]
    assert model.chat_template is not None
    ours = model.chat_template.prompt_token_ids(messages, model.tokenizer)
    theirs = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    assert ours == list(theirs)
    assert model.chat_template.render(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_a_template_is_sandboxed_and_a_broken_one_fails_at_load(tmp_path: Path, tokenizer_dir: Path) -> None:
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = "{{ messages.__class__.__mro__ }}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    template = ChatTemplate.from_dir(tmp_path)
    assert template is not None
    with pytest.raises(Exception, match=r"unsafe|access"):  # the sandbox refuses attribute games
        template.render([{"role": "user", "content": "x"}])
    config["chat_template"] = "{% for %}"
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate.from_dir(tmp_path)
    del config["chat_template"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert ChatTemplate.from_dir(tmp_path) is None


def test_usage_and_response_shapes() -> None:
    bill = Bill(
        cached_tokens=8,
        cached_tokens_by_tier=CachedByTier(device=3, host=4, store=1),
        speculation=Speculation(draft_tokens=5, accepted_tokens=2, steps=1),
    )
    used = usage(10, 4, bill)
    assert used == {
        "prompt_tokens": 10,
        "completion_tokens": 4,
        "total_tokens": 14,
        "prompt_tokens_details": {
            "cached_tokens": 8,
            "cached_tokens_by_tier": {"device": 3, "host": 4, "store": 1},
        },
        "completion_tokens_details": {"accepted_prediction_tokens": 2, "rejected_prediction_tokens": 3},
    }
    chat = ResponseShape.of(True, "chatcmpl-1", "tiny")
    whole = chat.response("hi", "stop", None, used)
    assert whole["object"] == "chat.completion" and whole["choices"][0]["message"]["content"] == "hi"
    first = chat.chunk(chat.choice("", None, None, first=True))
    assert first["object"] == "chat.completion.chunk" and first["choices"][0]["delta"]["role"] == "assistant"
    text = ResponseShape.of(False, "cmpl-1", "tiny")
    assert text.usage_chunk(used)["choices"] == [] and text.usage_chunk(used)["usage"] == used
    assert text.chunk(text.choice("x", "length", [5]))["choices"][0] == {
        "index": 0,
        "text": "x",
        "logprobs": None,
        "finish_reason": "length",
        "token_ids": [5],
    }


def test_a_retried_bills_cached_tokens_are_capped_at_the_prompt_store_first() -> None:
    """A retry bills its cached tokens again: OpenAI's cached_tokens is a part of prompt_tokens,
    so it is capped there, and the split still adds up to it."""
    split = CachedByTier(device=6, host=5, store=4)  # 15 over two attempts of a 10-token prompt
    details = usage(10, 1, Bill(cached_tokens=15, cached_tokens_by_tier=split))["prompt_tokens_details"]
    assert details == {"cached_tokens": 10, "cached_tokens_by_tier": {"device": 6, "host": 4, "store": 0}}
    assert cached_within(split, 5) == CachedByTier(5, 0, 0)
    assert cached_within(split, 13) == CachedByTier(6, 5, 2)
    assert cached_within(split, 100) == split


def test_the_official_client_parses_usage_with_the_tier_extension() -> None:
    """openai's response types keep fields they do not define: the sum in cached_tokens, the
    split beside it."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion

    bill = Bill(cached_tokens=7, cached_tokens_by_tier=CachedByTier(device=4, host=2, store=1))
    used = usage(9, 2, bill)
    chat = ChatCompletion.model_validate(
        ResponseShape.of(True, "chatcmpl-1", "tiny").response("hi", "stop", None, used)
    )
    assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
    details = chat.usage.prompt_tokens_details
    assert details.cached_tokens == 7
    assert details.model_dump()["cached_tokens_by_tier"] == {"device": 4, "host": 2, "store": 1}
    text = Completion.model_validate(
        ResponseShape.of(False, "cmpl-1", "tiny").response("hi", "length", None, used)
    )
    assert text.usage is not None and text.usage.prompt_tokens_details is not None
    assert text.usage.prompt_tokens_details.cached_tokens == 7


def test_the_apps_errors_over_http_before_any_cluster(tiny_dir: Path) -> None:
    """The app on a core that is not ready: health 503, auth 401, a body that is not JSON 400,
    a route that does not exist 404, a request that reaches the core 503, all in OpenAI's shape."""
    import httpx2 as httpx

    from tandem.frontend.openai_http import build_app

    core = FrontendCore(FrontendConfig(str(tiny_dir), "tiny", auth_token="alice:tok-a\nbob:tok-b"))
    app = build_app(core)

    async def calls() -> list[tuple[int, Any]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            ok = {"Authorization": "Bearer tok-b"}
            body = {"model": "tiny", "prompt": "x", "max_tokens": 2}
            replies = [
                await client.get("/health"),
                await client.post("/v1/completions", json=body),
                await client.post("/v1/completions", json=body, headers={"Authorization": "Bearer nope"}),
                await client.post("/v1/completions", content=b"{not json", headers=ok),
                await client.get("/v1/nothing", headers=ok),
                await client.post("/v1/completions", json=body, headers=ok),
                await client.get("/v1/models", headers=ok),
            ]
            return [(r.status_code, r.json()) for r in replies]

    replies = asyncio.run(calls())
    assert [status for status, _ in replies] == [503, 401, 401, 400, 404, 503, 200]
    for _, body in replies[1:6]:
        assert set(body["error"]) == {"message", "type", "param", "code"}
    assert replies[1][1]["error"]["message"].startswith("missing bearer token")
    assert replies[2][1]["error"]["code"] == "invalid_api_key"
    assert "not JSON" in replies[3][1]["error"]["message"]
    assert replies[4][1]["error"]["message"] == "no route GET /v1/nothing"
    assert replies[6][1]["data"][0]["id"] == "tiny"


def test_malformed_bodies_are_4xx_counted_and_every_response_carries_a_request_id(tiny_dir: Path) -> None:
    """Each malformed body (too deep, not UTF-8, not JSON, not an object, a form, too large, an
    unknown nested field) answers 4xx in OpenAI's shape and is counted in
    ``tandem_requests_total`` by its code; ``GET /v1/models/{id}`` answers the card or 404; every
    response carries the client's ``X-Request-Id`` or a new one."""
    import httpx2 as httpx

    from tandem.frontend.openai_http import MAX_JSON_DEPTH, build_app

    core = FrontendCore(FrontendConfig(str(tiny_dir), "tiny"))
    app = build_app(core)
    limit = core.config.limits.max_request_bytes
    json_type = {"Content-Type": "application/json"}
    deep = '{"model":"tiny","prompt":"x","metadata":' + "[" * MAX_JSON_DEPTH + "]" * MAX_JSON_DEPTH + "}"
    cases: list[tuple[bytes, dict[str, str], int, str]] = [
        (deep.encode(), json_type, 400, "nests deeper than 64 levels"),
        (b"[" * 200_000 + b"]" * 200_000, json_type, 400, "nests deeper"),  # past the parser's stack
        (b'{"model": "\xff"}', json_type, 400, "not JSON"),
        (b'{"model": "tiny", ', json_type, 400, "not JSON"),
        (b"[1, 2]", json_type, 400, "must be a JSON object"),
        (b"model=tiny&prompt=x", {"Content-Type": "application/x-www-form-urlencoded"}, 415, "must be JSON"),
        (b" " * (limit + 1), json_type, 413, f"passes {limit} bytes"),
        (json.dumps({"model": "tiny", "prompt": "x", "stream": True,
                     "stream_options": {"nope": 1}}).encode(), json_type, 400, "stream_options.nope"),
    ]  # fmt: skip

    async def calls() -> tuple[list[Any], list[Any]]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            refused = [
                await client.post("/v1/completions", content=body, headers=h) for body, h, _, _ in cases
            ]
            others = [
                await client.get("/v1/models/tiny", headers={"X-Request-Id": "trace-42"}),
                await client.get("/v1/models/gpt-4", headers={"X-Request-Id": "bad id"}),
                await client.put("/v1/completions", json={}),
                await client.post("/v1/completions", json={"model": "tiny", "prompt": "x", "store": True}),
            ]
            return refused, others

    refused, others = asyncio.run(calls())
    for reply, (_, _, status, words) in zip(refused, cases, strict=True):
        assert reply.status_code == status, (reply.status_code, reply.text)
        error = reply.json()["error"]
        assert words in (error["param"] or "") + error["message"], error
    card, unknown, method, unready = others
    assert card.status_code == 200 and card.json()["id"] == "tiny"
    assert card.headers["x-request-id"] == "trace-42"  # the client's, echoed
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
    made = unknown.headers["x-request-id"]  # not printable ASCII: one made here instead
    assert made != "bad id" and len(made) == 32 and all(r.headers["x-request-id"] for r in refused)
    assert method.status_code == 405 and "does not take PUT" in method.json()["error"]["message"]
    assert unready.status_code == 503  # accepted as far as the cluster (none here)
    assert core.metrics is not None
    counted = {
        sample.labels["code"]: sample.value
        for metric in core.metrics.registry.collect()
        for sample in metric.samples
        if sample.name == "tandem_requests_total" and sample.labels["finish_reason"] == "rejected"
    }
    assert counted == {
        "INVALID_ARGUMENT": 7,  # the six 400s and the 415
        "RESOURCE_EXHAUSTED": 1,
        "NOT_FOUND": 1,
        "UNIMPLEMENTED": 1,
        "UNAVAILABLE": 1,
    }


def test_a_temperature_below_the_greedy_bound_is_passed_on_as_greedy(model: ServedModel) -> None:
    for temperature in (5e-324, 1e-45, 1e-6):
        sampling = _completion(model, temperature=temperature).spec.sampling
        assert sampling.temperature == 0.0 and sampling.greedy
    assert _completion(model, temperature=1e-5).spec.sampling.temperature == 1e-5
