"""The OpenAI API's response bodies: a choice, a chunk, a whole response, the usage (with
``prompt_tokens_details.cached_tokens`` and Tandem's ``cached_tokens_by_tier``), and the finish
reason, for completions and chat alike (``ResponseShape``)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from tandem.wire.messages import Bill, CachedByTier
from tandem.wire.request_params import FinishReason


def finish_reason(reason: FinishReason, stopped_by_string: bool) -> str:
    """OpenAI's ``finish_reason``: a stop string, EOS or a stop token is ``stop``."""
    return "stop" if stopped_by_string else str(reason)


def cached_within(by_tier: CachedByTier, limit: int) -> CachedByTier:
    """``by_tier`` with at most ``limit`` tokens in all, the excess taken off the store's part
    first, then the host's, then the device's."""
    store = min(by_tier.store, max(0, limit - by_tier.device - by_tier.host))
    host = min(by_tier.host, max(0, limit - by_tier.device))
    return CachedByTier(min(by_tier.device, limit), host, store)


def usage(prompt_tokens: int, completion_tokens: int, bill: Bill) -> dict[str, Any]:
    """OpenAI's ``usage`` from the bill. ``prompt_tokens_details.cached_tokens`` is a part of
    ``prompt_tokens``, so the bill's (which counts a retry's or a re-prefill's tokens again) is
    capped at the prompt; ``cached_tokens_by_tier`` (an extension) splits it by the tier the
    tokens came from, ``device``, ``host`` and ``store``, and adds up to it."""
    cached = cached_within(bill.cached_tokens_by_tier, min(bill.cached_tokens, prompt_tokens))
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached.total, "cached_tokens_by_tier": cached.as_dict()},
        # speculative decoding's drafts, in the fields OpenAI gives predicted outputs
        "completion_tokens_details": {
            "accepted_prediction_tokens": bill.speculation.accepted_tokens,
            "rejected_prediction_tokens": bill.speculation.draft_tokens - bill.speculation.accepted_tokens,
        },
    }


@dataclass(frozen=True)
class ResponseShape:
    """How one endpoint's responses look: ids, object names, where the text goes."""

    chat: bool
    id: str
    model: str
    created: int
    index: int = 0  # the choice's (``n`` > 1: each choice's stream has its own)

    @staticmethod
    def of(chat: bool, request_id: str, model: str) -> ResponseShape:
        return ResponseShape(chat, request_id, model, int(time.time()))

    def _envelope(self, stream: bool, choices: list[dict[str, Any]]) -> dict[str, Any]:
        kind = ("chat.completion.chunk" if stream else "chat.completion") if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def choice(
        self,
        text: str,
        finish: str | None,
        token_ids: list[int] | None,
        first: bool = False,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        """A streamed choice (a chunk); ``first`` carries the assistant's role on chat."""
        delta: dict[str, Any] = {"role": "assistant", "content": text} if first else {"content": text}
        return self._choice("delta", delta, text, logprobs, finish, token_ids)

    def _choice(
        self,
        key: str,
        message: dict[str, Any],
        text: str | None,
        logprobs: dict[str, Any] | None,
        finish: str | None,
        token_ids: list[int] | None,
    ) -> dict[str, Any]:
        """A choice: on chat its ``message`` under ``key`` (``delta`` in a chunk), else ``text``."""
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            choice[key] = message
        else:
            choice["text"] = text
        choice |= {"logprobs": logprobs, "finish_reason": finish}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return choice

    def calls_choice(self, calls: list[dict[str, Any]]) -> dict[str, Any]:
        """A streamed chat choice carrying complete tool calls (each with its ``index``)."""
        return {"index": self.index, "delta": {"tool_calls": calls}, "logprobs": None, "finish_reason": None}

    def chunk(self, choice: dict[str, Any], seed: int | None = None) -> dict[str, Any]:
        """A streamed chunk; the last one (with the finish reason) carries the request's seed."""
        body = self._envelope(True, [choice])
        if seed is not None:
            body["seed"] = seed
        return body

    def usage_chunk(self, used: dict[str, Any]) -> dict[str, Any]:
        return {**self._envelope(True, []), "usage": used}

    def response(
        self,
        text: str | None,
        finish: str,
        token_ids: list[int] | None,
        used: dict[str, Any],
        seed: int | None = None,
        logprobs: dict[str, Any] | None = None,
        tool_calls: list[dict[str, Any]] | None = None,
    ) -> dict[str, Any]:
        """``tool_calls``: the chat output's parsed calls (then ``text`` is what came before them,
        ``None`` when nothing did)."""
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["content"], message["tool_calls"] = text or None, tool_calls
        choice = self._choice("message", message, text, logprobs, finish, token_ids)
        body = {**self._envelope(False, [choice]), "usage": used}
        if seed is not None:  # the seed of the request's draws (``seed``, an extension field)
            body["seed"] = seed
        return body
