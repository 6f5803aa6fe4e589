"""Prompts given on the command line or in a JSONL file, validated at the edge."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.wire.request_params import InvalidRequestError, SamplingParams

_SAMPLING_FIELDS = {f.name: f.type for f in dataclasses.fields(SamplingParams)}


@dataclass(frozen=True)
class PromptSpec:
    text: str | None
    token_ids: list[int] | None
    sampling: SamplingParams


def parse_prompt_ids(value: str, field: str = "--prompt-ids") -> list[int]:
    try:
        ids = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise InvalidRequestError(field, f"expected comma-separated integers, got {value!r}") from None
    if not ids:
        raise InvalidRequestError("prompt", "is empty")
    return ids


def _sampling_from(obj: dict[str, Any], base: SamplingParams, where: str) -> SamplingParams:
    changes: dict[str, Any] = {}
    for key in _SAMPLING_FIELDS:
        if key not in obj:
            continue
        value = obj[key]
        if key == "stop_token_ids":
            if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
                raise InvalidRequestError(f"{where}: stop_token_ids", "expected a list of integers")
            value = tuple(value)
        elif key == "ignore_eos":
            if not isinstance(value, bool):
                raise InvalidRequestError(f"{where}: ignore_eos", "expected true or false")
        elif key in ("max_tokens", "top_k", "seed"):
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequestError(f"{where}: {key}", f"expected an integer, got {value!r}")
        elif not isinstance(value, int | float) or isinstance(value, bool):
            raise InvalidRequestError(f"{where}: {key}", f"expected a number, got {value!r}")
        changes[key] = value
    sampling = dataclasses.replace(base, **changes)
    try:
        sampling.validate()
    except InvalidRequestError as exc:
        raise InvalidRequestError(f"{where}: {exc.field}", str(exc).split(": ", 1)[1]) from None
    return sampling


def read_prompts_file(path: Path, base: SamplingParams) -> list[PromptSpec]:
    """One JSON object a line: ``{"prompt": "..."}`` or ``{"prompt_ids": [...]}``, plus sampling fields."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise InvalidRequestError("--prompts-file", f"cannot read {path}: {exc.strerror}") from None
    known = {"prompt", "prompt_ids", *_SAMPLING_FIELDS}
    specs: list[PromptSpec] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidRequestError(where, f"not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise InvalidRequestError(where, "expected a JSON object")
        unknown = sorted(set(obj) - known)
        if unknown:
            raise InvalidRequestError(
                f"{where}: {unknown[0]}", f"unknown field; expected one of {sorted(known)}"
            )
        if ("prompt" in obj) == ("prompt_ids" in obj):
            raise InvalidRequestError(where, 'expected exactly one of "prompt" or "prompt_ids"')
        sampling = _sampling_from(obj, base, where)
        if "prompt" in obj:
            if not isinstance(obj["prompt"], str):
                raise InvalidRequestError(f"{where}: prompt", "expected a string")
            specs.append(PromptSpec(obj["prompt"], None, sampling))
        else:
            ids = obj["prompt_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids
            ):
                raise InvalidRequestError(f"{where}: prompt_ids", "expected a list of integers")
            specs.append(PromptSpec(None, ids, sampling))
    if not specs:
        raise InvalidRequestError("--prompts-file", f"{path} holds no prompts")
    return specs
