"""Tool calls on the chat API, in DeepSeek-V3's format: the checkpoint's chat template renders
``tools`` and the conversation's calls and results (``<｜tool▁calls▁begin｜>`` ...); the output's
calls are parsed back into OpenAI's ``tool_calls``, streamed as one delta a call once it is
complete.

``tool_choice``: ``none`` (the tools are rendered, the output is text), ``auto`` (the default
with tools: the model may call; its calls are parsed), ``required`` (at least one call, of any
tool) and a named function (exactly one call of it). The last two are enforced with a guide
(xgrammar's structural tag): the output is the calls' markers with arguments that validate
against each tool's ``parameters``. A template that does not render ``tools`` (DeepSeek-V3's own
leaves them out) gets them as a system message before the conversation (:func:`tools_text`).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tandem.frontend.openai_structured import GuideError
from tandem.wire.request_params import MAX_GUIDE_CHARS, Guide, GuideKind

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
ARGS_BEGIN, ARGS_END = "\n```json\n", "\n```"
MAX_TOOLS = 128  # OpenAI's
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_CALL = re.compile(
    re.escape(CALL_BEGIN) + r"(\w+)" + re.escape(SEP) + r"([^\n]*)" + re.escape(ARGS_BEGIN) + r"(.*?)"
    + re.escape(ARGS_END + CALL_END),
    re.DOTALL,
)  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class FunctionDefinition(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: FunctionName


class CalledFunction(_Strict):
    name: str
    arguments: str


class ToolCall(_Strict):
    """A call in an assistant message of the conversation."""

    id: str
    type: Literal["function"]
    function: CalledFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True)
class ToolPlan:
    """What a request's tools make of it: what the template gets, whether the output's calls
    are parsed, and the guide that enforces a call (``required`` or named)."""

    tools: list[dict[str, Any]]
    parse: bool
    guide: Guide | None


def plan_tools(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolPlan | None:
    """``None`` for a request without tools; errors name their field (``GuideError``)."""
    if not tools:
        if choice not in (None, "none"):
            raise GuideError("tool_choice", "needs tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise GuideError("tools", f"{len(tools)} tools; at most {MAX_TOOLS}")
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if not _NAME.match(name):
            raise GuideError(
                f"tools.{i}.function.name", "is 1 to 64 of a-z, A-Z, 0-9, _ and - (OpenAI's rule)"
            )
        if name in names[:i]:
            raise GuideError(f"tools.{i}.function.name", f"{name!r} is given twice")
    rendered = [t.model_dump(exclude_none=True) for t in tools]
    for entry in rendered:
        entry["function"].setdefault("parameters", {"type": "object", "properties": {}})
    choice = choice or "auto"
    if choice == "none":
        return ToolPlan(rendered, False, None)
    if choice == "auto":
        return ToolPlan(rendered, True, None)
    one_each = parallel is False
    if choice == "required":
        calls = [_call_tag(e["function"]) for e in rendered]
        inner = {
            "type": "tags_with_separator",
            "tags": calls,
            "separator": "\n",
            "at_least_one": True,
            "stop_after_first": one_each,
        }
        tag: dict[str, Any] = {"type": "tag", "begin": CALLS_BEGIN, "content": inner, "end": CALLS_END}
    else:
        assert isinstance(choice, NamedToolChoice)
        if choice.function.name not in names:
            raise GuideError("tool_choice.function.name", f"{choice.function.name!r} is not one of the tools")
        function = rendered[names.index(choice.function.name)]["function"]
        call = _call_tag(function)
        tag = {**call, "begin": CALLS_BEGIN + call["begin"], "end": call["end"] + CALLS_END}
    spec = json.dumps({"type": "structural_tag", "format": tag}, ensure_ascii=False, sort_keys=True)
    if len(spec) > MAX_GUIDE_CHARS:
        raise GuideError(
            "tools", f"the tools' schemas take {len(spec)} characters; at most {MAX_GUIDE_CHARS}"
        )
    return ToolPlan(rendered, True, Guide(GuideKind.STRUCTURAL_TAG, spec))


def _call_tag(function: dict[str, Any]) -> dict[str, Any]:
    """One call of ``function``: its header, arguments valid for its parameters (one space at
    most where JSON allows whitespace), its end."""
    return {
        "type": "tag",
        "begin": f"{CALL_BEGIN}function{SEP}{function['name']}{ARGS_BEGIN}",
        "content": {"type": "json_schema", "json_schema": function["parameters"], "max_whitespace_cnt": 1},
        "end": ARGS_END + CALL_END,
    }


def tools_text(tools: list[dict[str, Any]]) -> str:
    """The tools described for a template that does not render them."""
    lines = ["## Tools", "", "You have access to the following tools:"]
    for tool in tools:
        function = tool["function"]
        lines += ["", f"### {function['name']}", f"Description: {function.get('description', '')}", ""]
        lines.append(f"Parameters: {json.dumps(function['parameters'], ensure_ascii=False)}")
    lines += [
        "",
        "IMPORTANT: ALWAYS adhere to this exact format for tool use:",
        f"{CALLS_BEGIN}{CALL_BEGIN}function{SEP}tool_name{ARGS_BEGIN}arguments{ARGS_END}{CALL_END}{CALLS_END}",
        "",
    ]
    return "\n".join(lines)


def _called(match: re.Match[str]) -> dict[str, Any]:
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": match.group(2).strip(), "arguments": match.group(3)},
    }


def parse_calls(text: str, cut: bool = False) -> tuple[str | None, list[dict[str, Any]]]:
    """The output's content (what comes before its calls; ``None`` when empty and there are
    calls) and its calls in OpenAI's shape. Text without the calls' marker is all content.
    ``cut``: the output was cut short (``max_tokens``): the text after its last complete call
    (the call it was cut in) is content too, after the text before the calls, never dropped."""
    at = text.find(CALLS_BEGIN)
    if at < 0:
        return text, []
    matches = list(_CALL.finditer(text, at))
    if not matches:  # a marker and no complete call (cut by max_tokens): left as text
        return text, []
    content = text[:at] + (text[matches[-1].end() :] if cut else "")
    return (content or None), [_called(m) for m in matches]


class CallStream:
    """Streamed text split into content and complete calls: :meth:`feed` gives the content that
    is safe to send (text that may begin the calls' marker is held) and the calls completed."""

    def __init__(self) -> None:
        self._held = ""
        self._in_calls = False
        self.calls = 0

    def feed(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        self._held += text
        if not self._in_calls:
            at = self._held.find(CALLS_BEGIN)
            if at < 0:
                keep = held_back(self._held, CALLS_BEGIN)
                content, self._held = (
                    self._held[: len(self._held) - keep],
                    self._held[len(self._held) - keep :],
                )
                return content, []
            content, self._held, self._in_calls = self._held[:at], self._held[at + len(CALLS_BEGIN) :], True
        else:
            content = ""
        calls = []
        while (match := _CALL.search(self._held)) is not None:
            call = _called(match)
            call["index"] = self.calls
            calls.append(call)
            self.calls += 1
            self._held = self._held[match.end() :]
        return content, calls

    def finish(self, cut: bool = False) -> str:
        """What is left as content when the output ends: held text; after complete calls
        nothing (their separators and end marker), or with ``cut`` (``max_tokens`` ended it)
        the text after the last call, the call it was cut in; a marker with no complete call,
        all of it (as ``parse_calls`` has it)."""
        held, self._held = self._held, ""
        if not self._in_calls:
            return held
        if self.calls:
            return held if cut else ""
        return CALLS_BEGIN + held


def held_back(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that begins ``marker`` (and is shorter than
    it): what a stream holds back until the next piece tells whether the marker comes."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
