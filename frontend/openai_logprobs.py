"""Logprobs in the OpenAI API's two shapes.

Completions (the legacy shape, which lm-eval's loglikelihood tasks read)::

    {"tokens": ["The", " cat"], "token_logprobs": [null, -2.3],
     "top_logprobs": [null, {" cat": -2.3, " dog": -1.9}], "text_offset": [0, 3]}

``top_logprobs[i]`` holds the token's own entry and its ``k`` likeliest, so ``k = 1`` gives a
one- or two-entry map. An echoed prompt's first token has ``null``: no logits precede it.

Chat::

    {"content": [{"token": " cat", "logprob": -2.3, "bytes": [32, 99, 97, 116],
                  "top_logprobs": [{"token": " dog", "logprob": -1.9, "bytes": [...]}, ...]}]}

A token is named by its text; one that is not a whole UTF-8 character on its own (a byte of a
multi-byte character) is named ``bytes:\\xe4`` as vLLM does, so two such tokens never share a
name (a map keyed by text would merge them). ``bytes`` is always the token's own bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.model.tokenizer import Tokenizer
from tandem.wire.logprobs import TokenLogprobs


class TokenNames:
    """Each token's name and bytes as the logprobs show them, cached (one per tokenizer)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._names: dict[int, tuple[str, list[int]]] = {}

    def of(self, token_id: int) -> tuple[str, list[int]]:
        found = self._names.get(token_id)
        if found is None:
            raw = self.tokenizer.token_bytes(token_id)
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                name = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            found = self._names[token_id] = (name, list(raw))
        return found

    def name(self, token_id: int) -> str:
        return self.of(token_id)[0]


def completion_logprobs(
    names: TokenNames, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None], text_offset: int
) -> dict[str, Any]:
    """The completions shape for ``token_ids`` (an echoed prompt's, then the output's), their
    offsets counted from ``text_offset`` in the choice's text by each token's name."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    at = text_offset
    for token, entry in zip(token_ids, entries, strict=True):
        name = names.name(token)
        tokens.append(name)
        offsets.append(at)
        at += len(name)
        if entry is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        token_logprobs.append(entry.logprob)
        top = {names.name(t): lp for t, lp in entry.top}
        top.setdefault(name, entry.logprob)
        top_logprobs.append(top)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": offsets,
    }


def chat_logprobs(
    names: TokenNames, token_ids: Sequence[int], entries: Sequence[TokenLogprobs | None]
) -> dict[str, Any]:
    """The chat shape for output tokens ``token_ids``."""

    def item(token: int, logprob: float) -> dict[str, Any]:
        name, raw = names.of(token)
        return {"token": name, "logprob": logprob, "bytes": raw}

    content = []
    for token, entry in zip(token_ids, entries, strict=True):
        if entry is None:  # an output resumed from a failed rank's stream: none came
            content.append({**item(token, float("nan")), "logprob": None, "top_logprobs": []})
            continue
        content.append({**item(token, entry.logprob), "top_logprobs": [item(t, lp) for t, lp in entry.top]})
    return {"content": content}
