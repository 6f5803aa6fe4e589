"""Tool calls in DeepSeek-V3's format: what a request's tools make of it, and the calls parsed
out of the output, whole or streamed in any split."""

from __future__ import annotations

import json

import pytest

from tandem.frontend.openai_structured import GuideError
from tandem.frontend.openai_tools import (
    ARGS_BEGIN,
    ARGS_END,
    CALL_BEGIN,
    CALL_END,
    CALLS_BEGIN,
    CALLS_END,
    SEP,
    CallStream,
    NamedToolChoice,
    Tool,
    parse_calls,
    plan_tools,
)
from tandem.wire.request_params import GuideKind

TOOL = Tool.model_validate(
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
)
BARE = Tool.model_validate({"type": "function", "function": {"name": "now"}})


def _call(name: str, args: str) -> str:
    return f"{CALL_BEGIN}function{SEP}{name}{ARGS_BEGIN}{args}{ARGS_END}{CALL_END}"


OUTPUT = (
    "Let me look."
    + CALLS_BEGIN
    + _call("get_weather", '{"city": "Ur"}')
    + "\n"
    + _call("now", "{}")
    + CALLS_END
)


def test_the_calls_are_parsed_with_the_content_before_them() -> None:
    content, calls = parse_calls(OUTPUT)
    assert content == "Let me look."
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in calls] == [
        ("get_weather", '{"city": "Ur"}'),
        ("now", "{}"),
    ]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2
    assert parse_calls("plain text") == ("plain text", [])
    cut = OUTPUT[: OUTPUT.index("Ur")]  # max_tokens came first: no complete call, all text
    assert parse_calls(cut) == (cut, [])


@pytest.mark.parametrize("size", [1, 2, 3, 7, 50])
def test_streamed_in_any_split_the_same_calls_and_content_come(size: int) -> None:
    stream, content, calls = CallStream(), "", []
    for at in range(0, len(OUTPUT), size):
        text, done = stream.feed(OUTPUT[at : at + size])
        content += text
        calls += done
        if CALLS_BEGIN[:3] in OUTPUT[: at + size]:  # nothing of the marker leaks into the content
            assert CALLS_BEGIN[:1] not in content
    content += stream.finish()
    assert content == "Let me look."
    assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather"), (1, "now")]
    lone = CallStream()
    assert lone.feed("no calls <")[0] == "no calls " and lone.finish() == "<"


def test_required_and_named_choices_are_guides_auto_and_none_are_not() -> None:
    required = plan_tools([TOOL, BARE], "required", None)
    assert required is not None and required.parse and required.guide is not None
    assert required.guide.kind is GuideKind.STRUCTURAL_TAG
    tag = json.loads(required.guide.spec)["format"]
    assert tag["begin"] == CALLS_BEGIN and len(tag["content"]["tags"]) == 2
    assert tag["content"]["stop_after_first"] is False
    one = plan_tools([TOOL], "required", False)
    assert one is not None and one.guide is not None
    assert json.loads(one.guide.spec)["format"]["content"]["stop_after_first"] is True
    named = plan_tools(
        [TOOL, BARE], NamedToolChoice.model_validate({"type": "function", "function": {"name": "now"}}), None
    )
    assert named is not None and named.guide is not None
    assert f"{SEP}now{ARGS_BEGIN}" in json.loads(named.guide.spec)["format"]["begin"]
    auto = plan_tools([TOOL], None, None)
    assert auto is not None and auto.parse and auto.guide is None
    assert auto.tools[0]["function"]["parameters"] == {"type": "object"}
    none = plan_tools([BARE], "none", None)
    assert none is not None and not none.parse and none.guide is None
    assert none.tools[0]["function"]["parameters"] == {"type": "object", "properties": {}}
    assert plan_tools(None, None, None) is None


def test_a_wrong_choice_names_its_field() -> None:
    with pytest.raises(GuideError) as info:
        plan_tools(None, "required", None)
    assert info.value.field == "tool_choice"
    with pytest.raises(GuideError) as info:
        plan_tools(
            [TOOL], NamedToolChoice.model_validate({"type": "function", "function": {"name": "x"}}), None
        )
    assert info.value.field == "tool_choice.function.name"
    bad = Tool.model_validate({"type": "function", "function": {"name": "has space"}})
    with pytest.raises(GuideError) as info:
        plan_tools([bad], None, None)
    assert info.value.field == "tools.0.function.name"
