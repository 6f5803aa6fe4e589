"""Log-probabilities of tokens, as a rank computes them and the edges return them.

A position's entry is the token there with its log-probability and the ``top`` likeliest tokens
of the distribution it was drawn from, likeliest first. The distribution is the model's: the
log-softmax of its float32 logits before any sampling adjustment (penalties, temperature,
top-k/top-p/min-p), as OpenAI and vLLM define the values they return. An output token's entry
comes from the logits that sampled it; a prompt token's from the logits of the position before
it (the prompt's first token has none).

Across processes an entry travels as ``[token, logprob, [[token, logprob], ...]]`` (JSON-safe:
a KV notification carries the prompt's and the first output's); ``parse`` checks that shape.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.wire.request_params import MAX_LOGPROBS


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

    def as_list(self) -> list[Any]:
        return [self.token_id, self.logprob, [[t, p] for t, p in self.top]]

    @staticmethod
    def parse(raw: Any) -> TokenLogprobs:
        """From ``as_list``'s shape; ``ValueError`` naming what is wrong."""
        if not isinstance(raw, list | tuple) or len(raw) != 3:
            raise ValueError(f"a logprobs entry is [token, logprob, top], got {raw!r}")
        token, logprob, top = raw
        pairs = []
        for pair in top if isinstance(top, list | tuple) else [None]:
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                raise ValueError(f"a top logprob is [token, logprob], got {pair!r}")
            pairs.append((_token(pair[0]), _logprob(pair[1])))
        if len(pairs) > MAX_LOGPROBS:
            raise ValueError(f"{len(pairs)} top logprobs, more than {MAX_LOGPROBS}")
        return TokenLogprobs(_token(token), _logprob(logprob), tuple(pairs))


def _token(value: Any) -> int:
    if type(value) is not int or value < 0:
        raise ValueError(f"a token id is an integer >= 0, got {value!r}")
    return value


def _logprob(value: Any) -> float:
    if type(value) not in (int, float) or math.isnan(value) or value > 0:
        raise ValueError(f"a logprob is a number <= 0 (or -inf), got {value!r}")
    return float(value)


def encode_all(entries: Sequence[TokenLogprobs | None]) -> list[Any]:
    return [None if e is None else e.as_list() for e in entries]


def parse_all(raw: Any, field: str) -> tuple[TokenLogprobs | None, ...]:
    """A list of entries (``None`` where a position has none); ``ValueError`` naming ``field``."""
    if raw is None:
        return ()
    if not isinstance(raw, list | tuple):
        raise ValueError(f"{field}: must be a list, got {type(raw).__name__}")
    try:
        return tuple(None if e is None else TokenLogprobs.parse(e) for e in raw)
    except ValueError as error:
        raise ValueError(f"{field}: {error}") from None
