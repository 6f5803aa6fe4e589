"""Structured outputs end to end on the demo model (the one ``tandem serve`` runs by default),
spoken to with the official ``openai`` client and over gRPC: a prefill and a decode rank on
loopback (Ray, NIXL), the prefill rank sampling each request's first token under its grammar
and the decode rank the rest. One server for the module.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import jsonschema
import openai
import pytest
import ray

from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import PoolSpec, Topology
from tandem.frontend.openai_tools import CALL_BEGIN
from tandem.protos import tandem_pb2, tandem_pb2_grpc
from tests.listening import descendants

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tribe": {"enum": ["Judah", "Levi", "Benjamin"]},
        "faithful": {"type": "boolean"},
    },
    "required": ["name", "age", "tribe", "faithful"],
    "additionalProperties": False,
}


@dataclass
class Served:
    server: Server
    base_url: str
    grpc_addr: str

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key="none", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    pool = PoolSpec(dep=1, page_size=16, num_pages=256)
    topology = Topology.preset("local").model_copy(update={"prefill": pool, "decode": pool})
    server = Server(ServeOptions(topology, port=0, http_port=0))
    try:
        server.start()
        assert server.http_address is not None
        yield Served(server, f"http://{server.http_address}/v1", f"127.0.0.1:{server.port}")
    finally:
        server.stop()
        ray.shutdown()


def _person(served: Served, seed: int) -> tuple[str, str | None]:
    reply = served.client().chat.completions.create(
        model=served.server.model_name,
        messages=[{"role": "user", "content": "Who went up to Jerusalem?"}],
        temperature=1.0,
        seed=seed,
        max_tokens=120,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": PERSON, "strict": True},
        },
    )
    choice = reply.choices[0]
    return choice.message.content or "", choice.finish_reason


def test_twenty_requests_at_temperature_one_all_validate_against_the_schema(served: Served) -> None:
    with ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda seed: _person(served, seed), range(20)))
    for text, finish in replies:
        assert finish == "stop", text
        jsonschema.validate(json.loads(text), PERSON)
    assert len({text for text, _ in replies}) > 10  # sampled, not one forced answer


def test_a_json_object_a_regex_a_choice_and_a_grammar(served: Served) -> None:
    client, model = served.client(), served.server.model_name

    def complete(**extra: Any) -> str:
        reply = client.completions.create(
            model=model, prompt="And the LORD said", max_tokens=48, temperature=1.0, seed=3, extra_body=extra
        )
        assert reply.choices[0].finish_reason == "stop", reply.choices[0].text
        return reply.choices[0].text

    assert re.fullmatch(
        r"(yea|nay), [a-z]{3,8}\.", complete(structured_outputs={"regex": r"(yea|nay), [a-z]{3,8}\."})
    )
    assert complete(structured_outputs={"choice": ["Moses", "Aaron", "Miriam"]}) in {
        "Moses",
        "Aaron",
        "Miriam",
    }
    grammar = 'root ::= "Thus saith " name "."\nname ::= "Moses" | "the LORD" | [A-Z] [a-z]{2,6}'
    assert re.fullmatch(
        r"Thus saith (Moses|the LORD|[A-Z][a-z]{2,6})\.", complete(structured_outputs={"grammar": grammar})
    )
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "an empty answer"}],
        max_tokens=200,
        temperature=0.0,
        response_format={"type": "json_object"},
    )
    text = reply.choices[0].message.content or ""
    assert text.startswith("{")
    if reply.choices[0].finish_reason == "stop":  # an object may run past the budget: a prefix then
        assert isinstance(json.loads(text), dict)


def test_streamed_deltas_join_into_a_valid_document(served: Served) -> None:
    stream = served.client().chat.completions.create(
        model=served.server.model_name,
        messages=[{"role": "user", "content": "Name one."}],
        temperature=1.0,
        seed=11,
        max_tokens=120,
        stream=True,
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
    )
    text, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            text += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "stop"
    jsonschema.validate(json.loads(text), PERSON)


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "nonsense"}},
                }
            },
            "response_format.json_schema.schema",
            "nonsense",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "is required"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "has space", "schema": {}}}},
            "response_format.json_schema.name",
            "64",
        ),
        ({"structured_outputs": {"regex": "(ab"}}, "structured_outputs.regex", "parenthesis"),
        ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one"),
        (
            {"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
            "structured_outputs",
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format", "json_schema"),
        ({"structured_outputs": {"made_up": 1}}, "structured_outputs.made_up", "unknown field"),
    ],
)
def test_a_structured_output_asked_wrongly_is_a_400_naming_it(
    served: Served, fields: dict[str, Any], param: str, says: str
) -> None:
    error = _refused(served, fields)
    assert error["param"] == param and says in error["message"], error


def _refused(served: Served, fields: dict[str, Any]) -> dict[str, Any]:
    """The 400's error of a chat request with ``fields``, sent with the official client."""
    body = {"model": served.server.model_name, "messages": [{"role": "user", "content": "hi"}], **fields}
    with pytest.raises(openai.BadRequestError) as info:
        served.client().post("/chat/completions", body=body, cast_to=object)
    error = info.value.body
    assert isinstance(error, dict), error
    return error


def test_the_grpc_fields_guide_the_same_way_and_a_bad_spec_is_invalid_argument(served: Served) -> None:
    with grpc.insecure_channel(served.grpc_addr) as channel:
        stub = tandem_pb2_grpc.TandemStub(channel)

        def run(**structure: Any) -> str:
            sampling = tandem_pb2.SamplingParams(max_tokens=120, temperature=1.0, seed=5, **structure)
            request = tandem_pb2.GenerateRequest(text="In the beginning", sampling=sampling)
            replies = list(stub.Generate(request, timeout=120))
            assert replies[-1].summary.finish_reason == "stop"
            return "".join(r.chunk.text for r in replies if r.HasField("chunk"))

        jsonschema.validate(json.loads(run(json_schema=json.dumps(PERSON))), PERSON)
        assert re.fullmatch(r"[0-9]{3}-[0-9]{4}", run(regex=r"[0-9]{3}-[0-9]{4}"))
        with pytest.raises(grpc.RpcError) as info:
            run(regex="(ab")
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "sampling.regex" in (info.value.details() or "")


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 16},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
CENSUS = {
    "type": "function",
    "function": {
        "name": "count_tribe",
        "parameters": {
            "type": "object",
            "properties": {"tribe": {"enum": ["Judah", "Levi"]}},
            "required": ["tribe"],
        },
    },
}


def _tools_reply(served: Served, seed: int, **fields: Any) -> Any:
    return served.client().chat.completions.create(
        model=served.server.model_name,
        messages=[{"role": "user", "content": "What is the weather in Hebron?"}],
        tools=[WEATHER, CENSUS],
        temperature=1.0,
        seed=seed,
        max_tokens=400,
        **fields,
    )


def test_a_required_tool_call_is_parsed_and_its_arguments_validate(served: Served) -> None:
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, CENSUS)}
    for seed in range(3):
        reply = _tools_reply(served, seed, tool_choice="required")
        choice = reply.choices[0]
        assert choice.message.tool_calls, choice.message
        if choice.finish_reason == "length":  # max_tokens ended it inside a later call: its text
            assert reply.usage is not None and reply.usage.completion_tokens == 400
            assert CALL_BEGIN in (choice.message.content or ""), choice.message
        else:
            assert choice.finish_reason == "tool_calls", choice.message
        for call in choice.message.tool_calls:
            assert call.type == "function" and call.id.startswith("call_")
            jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    named = _tools_reply(
        served, 7, tool_choice={"type": "function", "function": {"name": "count_tribe"}}
    ).choices[0]
    assert named.finish_reason == "tool_calls" and named.message.tool_calls is not None
    (call,) = named.message.tool_calls
    assert call.function.name == "count_tribe"
    assert json.loads(call.function.arguments)["tribe"] in ("Judah", "Levi")


def test_a_streamed_tool_call_comes_as_a_delta_once_complete(served: Served) -> None:
    stream = _tools_reply(
        served, 3, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True
    )
    calls, finish, content = [], None, ""
    for chunk in stream:
        for choice in chunk.choices:
            calls += choice.delta.tool_calls or []
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert finish == "tool_calls" and content == ""
    (call,) = calls
    assert call.index == 0 and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])  # type: ignore[index]


def test_a_conversation_with_calls_and_their_results_renders_and_answers(served: Served) -> None:
    messages: list[Any] = [
        {"role": "user", "content": "What is the weather in Hebron?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Hebron", "unit": "celsius"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "hot and dry"},
    ]
    reply = served.client().chat.completions.create(
        model=served.server.model_name, messages=messages, tools=[WEATHER], max_tokens=16, seed=1
    )
    choice = reply.choices[0]
    assert choice.finish_reason in ("stop", "length", "tool_calls")
    assert reply.usage is not None and reply.usage.prompt_tokens > 100  # the tools were rendered


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            "tool_choice.function.name",
        ),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
        (
            {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
            "tool_choice",
        ),
        ({"messages": [{"role": "tool", "content": "x"}]}, "messages"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no"}}}],
                "tool_choice": "required",
            },
            "tools",
        ),
    ],
)
def test_tools_asked_wrongly_are_a_400_naming_the_field(
    served: Served, fields: dict[str, Any], param: str
) -> None:
    error = _refused(served, fields)
    assert error["param"] == param, error


def _frontend_pids() -> list[int]:
    """This test's frontend actors: the Ray workers (below this process) titled ``ray::Frontend``."""
    found = []
    for pid in descendants(os.getpid()):
        with contextlib.suppress(OSError):
            if Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::Frontend"):
                found.append(pid)
    return found


def test_the_frontend_serves_a_structured_output_without_loading_torch(served: Served) -> None:
    """The frontend compiled and checked the request's schema (the edge's check) and streamed it,
    with no torch library mapped in its process: its grammar half is the torch-free compiler."""
    content, finish = _person(served, seed=7)
    assert finish == "stop"
    jsonschema.validate(json.loads(content), PERSON)
    pids = _frontend_pids()
    assert pids, "no frontend process found"
    for pid in pids:
        maps = Path(f"/proc/{pid}/maps").read_text()
        assert "libtorch" not in maps, f"frontend {pid} maps torch"
