"""A model's chat template: ``tokenizer_config.json``'s ``chat_template`` (Jinja), rendered in a
sandbox with the messages, ``add_generation_prompt=True`` and the BOS and EOS strings, as Hugging
Face's ``apply_chat_template`` renders it. A model without one serves no chat requests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, NoReturn

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tandem.model.tokenizer import TOKENIZER_CONFIG_FILE, Tokenizer
from tandem.wire.request_params import InvalidRequestError


class ChatTemplateError(ValueError):
    """The model's chat template cannot be read or compiled."""


@dataclass(frozen=True)
class ChatTemplate:
    source: str
    bos_token: str
    eos_token: str

    @staticmethod
    def from_dir(model_dir: Path | str) -> ChatTemplate | None:
        """The template of ``model_dir/tokenizer_config.json``; ``None`` when it has none."""
        path = Path(model_dir) / TOKENIZER_CONFIG_FILE
        if not path.is_file():
            return None
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as exc:
            raise ChatTemplateError(f"{path}: cannot read: {exc}") from None
        source = config.get("chat_template") if isinstance(config, dict) else None
        if isinstance(source, list):  # named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if not source:
            return None
        if not isinstance(source, str):
            raise ChatTemplateError(f"{path}: chat_template must be a string")
        template = ChatTemplate(
            source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        )
        try:
            template.compiled  # noqa: B018 (compiled once, here: a broken template fails the start)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"{path}: chat_template does not compile: {exc}") from None
        return template

    @cached_property
    def compiled(self) -> jinja2.Template:
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        env.globals["raise_exception"] = _raise_exception
        return env.from_string(self.source)

    @property
    def renders_tools(self) -> bool:
        """Whether the template reads ``tools`` (one that does not is given them as text)."""
        return "tools" in self.source

    def render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        """The prompt text of ``messages`` (and ``tools``, OpenAI's shape); a template that
        refuses them (``raise_exception``) or fails on them is the request's error, on
        ``messages``."""
        try:
            return self.compiled.render(
                messages=messages,
                tools=tools,
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as exc:
            raise InvalidRequestError("messages", f"the model's chat template refused them: {exc}") from None

    def prompt_token_ids(
        self, messages: list[dict[str, Any]], tokenizer: Tokenizer, tools: list[dict[str, Any]] | None = None
    ) -> list[int]:
        """The rendered prompt's tokens. A template that writes the BOS itself and a tokenizer
        that adds one would give two: the tokenizer's is dropped."""
        ids = tokenizer.encode(self.render(messages, tools))
        bos = tokenizer.bos_token_id
        if bos is not None and len(ids) >= 2 and ids[0] == ids[1] == bos:
            ids = ids[1:]
        return ids


def _token_text(token: Any) -> str:
    """A special token as ``tokenizer_config.json`` writes it: a string or ``{"content": ...}``."""
    if isinstance(token, dict):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)
