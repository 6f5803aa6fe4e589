"""Structured outputs on the OpenAI API: OpenAI's ``response_format`` (``text``, ``json_object``,
``json_schema`` with its ``name``, ``schema``, ``strict``, ``description``) and vLLM's extension
``structured_outputs`` (exactly one of ``json``, ``json_object``, ``regex``, ``grammar`` (EBNF),
``choice`` (one of the strings given) or ``structural_tag`` (xgrammar's, as JSON)), each as the
one :class:`Guide` a request may have. Whether the spec compiles is checked after this
(``FrontendCore.check_guide``), with the same field named.

A schema is enforced whether or not ``strict`` is set: the output always validates (OpenAI's
``strict: false`` promises less). The JSON is compact: no whitespace between its tokens.
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tandem.wire.request_params import MAX_GUIDE_CHARS, Guide, GuideKind

_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for a schema's (and a tool's) name
MAX_CHOICES_OF_TEXT = 256


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's ``structured_outputs``: one of its fields."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    grammar: str | None = None
    choice: list[str] | None = None
    structural_tag: str | None = None


class GuideError(ValueError):
    """A structured output asked for wrongly; ``field`` names where."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field, self.message = field, message


def guide_of(
    response_format: ResponseFormat | None, structured: StructuredOutputs | None
) -> tuple[Guide | None, str]:
    """The request's guide and the field it came from (``None``, "" for plain text)."""
    from_format = _from_response_format(response_format)
    from_structured = _from_structured(structured)
    if from_format[0] is not None and from_structured[0] is not None:
        raise GuideError("structured_outputs", "cannot be given with a response_format other than text")
    return from_format if from_format[0] is not None else from_structured


def _from_response_format(given: ResponseFormat | None) -> tuple[Guide | None, str]:
    if given is None or given.type == "text":
        if given is not None and given.json_schema is not None:
            raise GuideError("response_format.json_schema", "only applies with type json_schema")
        return None, ""
    if given.type == "json_object":
        if given.json_schema is not None:
            raise GuideError("response_format.json_schema", "only applies with type json_schema")
        return Guide(GuideKind.JSON_OBJECT), "response_format"
    spec = given.json_schema
    if spec is None:
        raise GuideError("response_format.json_schema", "is required with type json_schema")
    if not _NAME.match(spec.name):
        raise GuideError(
            "response_format.json_schema.name", "is 1 to 64 of a-z, A-Z, 0-9, _ and - (OpenAI's rule)"
        )
    schema = spec.schema_ if spec.schema_ is not None else {}  # OpenAI: absent means any JSON
    return _schema_guide(schema, "response_format.json_schema.schema")


def _from_structured(given: StructuredOutputs | None) -> tuple[Guide | None, str]:
    if given is None:
        return None, ""
    set_fields = [
        name
        for name in ("json_", "json_object", "regex", "grammar", "choice", "structural_tag")
        if getattr(given, name) not in (None, False)
    ]
    if len(set_fields) != 1:
        shown = [n.rstrip("_") for n in set_fields]
        raise GuideError("structured_outputs", f"give exactly one of its fields, got {shown or 'none'}")
    name = set_fields[0]
    field = f"structured_outputs.{name.rstrip('_')}"
    if name == "json_":
        schema = given.json_
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GuideError(field, f"is not JSON: {exc}") from None
        return _schema_guide(schema, field)
    if name == "json_object":
        return Guide(GuideKind.JSON_OBJECT), field
    if name == "choice":
        choices = given.choice or []
        if not 1 <= len(choices) <= MAX_CHOICES_OF_TEXT or not all(choices):
            raise GuideError(field, f"1 to {MAX_CHOICES_OF_TEXT} non-empty strings")
        grammar = "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return _sized(Guide(GuideKind.GRAMMAR, grammar), field)
    kind = {"regex": GuideKind.REGEX, "grammar": GuideKind.GRAMMAR}.get(name, GuideKind.STRUCTURAL_TAG)
    text = getattr(given, name)
    if not text:
        raise GuideError(field, "is empty")
    return _sized(Guide(kind, text), field)


def _schema_guide(schema: Any, field: str) -> tuple[Guide, str]:
    if not isinstance(schema, dict):
        raise GuideError(field, f"a JSON Schema is an object, got {type(schema).__name__}")
    return _sized(Guide(GuideKind.JSON_SCHEMA, json.dumps(schema, sort_keys=True)), field)


def _sized(guide: Guide, field: str) -> tuple[Guide, str]:
    if len(guide.spec) > MAX_GUIDE_CHARS:
        raise GuideError(field, f"{len(guide.spec)} characters; at most {MAX_GUIDE_CHARS}")
    return guide, field
