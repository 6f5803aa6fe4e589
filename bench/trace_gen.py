"""Generated Mooncake-format traces for ``tandem bench router`` and ``tandem bench autoscale``:
long prompts over shared documents, and bursts of short chat prompts.

``tandem bench trace --shape long-prompt|bursty-short --out F [--seed S] [--duration-s D]`` writes one JSON
object a line, as the Mooncake release does (``timestamp`` ms, ``input_length``,
``output_length``, ``hash_ids`` of 512-token blocks; equal ids = the same prefix).

The long-prompt shape: sessions arrive as a Poisson process; each reads one document (a
contract, a code base, a report) picked by Zipf popularity, behind a system prompt every
request shares, and asks a few questions in turn, each turn's prompt carrying the previous
turns' questions and answers::

    turn k prompt = system | document d | q1 a1 | ... | q(k-1) a(k-1) | qk

So prompts share long prefixes two ways: every session on a document shares it, and each turn
shares its whole history with the next. With the defaults prompts average ~15k tokens (measured
with the default seed: see ``write_trace``'s figures), ~2.8 requests/s arrive for 30 minutes,
~42k prompt tokens/s: 8 ranks of 6,000 tokens/s would run ~87% busy without a cache, about
the conversation trace's load.

The bursty short-prompt shape (:class:`BurstyShortShape`): chat and tool calls behind one of a
few system prompts, arriving as a Poisson process whose rate jumps by ``burst_factor`` during
bursts (they start as a Poisson process, last an exponential time): prompts of a few hundred
to a few thousand tokens, short answers, and load that changes within seconds, faster than a
group starts. With the defaults (seed 0): ~19 requests/s, prompts ~2.1k tokens, ~40k prompt tokens/s.

A block's hash id names its whole prefix: it is the id of the pair (previous block's id, the
pieces of segments the block covers), so two prompts get the same id for block i exactly when
their first (i + 1) x 512 tokens are the same segments. The last, partial block gets an id too.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BLOCK_TOKENS = 512

Segment = tuple[tuple[object, ...], int]  # (what it is, its tokens)


@dataclass(frozen=True)
class LongPromptShape:
    """Parameters of the long-prompt trace; every draw comes from ``random.Random(seed)``."""

    seed: int = 0
    duration_s: float = 1_800.0  # arrivals span this; turns that would come later are left out
    sessions_per_s: float = 1.0
    documents: int = 3_000  # distinct documents sessions read
    document_zipf: float = 0.8  # popularity of the i-th document ~ 1 / i^s
    document_tokens_median: int = 9_000  # lognormal, sigma 0.6, clipped to [1,000, 64,000]
    system_tokens: int = 1_200  # shared by every request
    turns_mean: float = 4.0  # geometric, at least 1
    question_tokens: tuple[int, int] = (100, 1_500)  # uniform
    answer_tokens_mean: int = 350  # exponential, clipped to [16, 2,000]: the turn's output_length
    think_s_mean: float = 120.0  # exponential, between an answer and the next question
    decode_step_s: float = 0.03  # an answer takes output_length of these

    def __post_init__(self) -> None:
        for name in ("duration_s", "sessions_per_s", "turns_mean", "think_s_mean", "document_zipf"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.documents < 1 or self.document_tokens_median < 1 or self.system_tokens < 0:
            raise ValueError(f"bad document shape: {self.documents=} {self.document_tokens_median=}")
        low, high = self.question_tokens
        if not 1 <= low <= high:
            raise ValueError(f"question_tokens must be 1 <= low <= high, got {self.question_tokens}")


@dataclass(frozen=True)
class BurstyShortShape:
    """Parameters of the bursty short-prompt trace; every draw comes from ``random.Random(seed)``."""

    seed: int = 0
    duration_s: float = 1_800.0
    requests_per_s: float = 12.0  # between bursts
    burst_factor: float = 4.0  # the rate within a burst, times requests_per_s
    bursts_per_s: float = 1.0 / 90.0
    burst_s_mean: float = 20.0  # exponential
    system_prompts: int = 8  # picked by Zipf (s = 1) popularity
    system_tokens: tuple[int, int] = (300, 2_500)  # uniform, one length per system prompt
    user_tokens_median: int = 400  # lognormal, sigma 0.8, clipped to [16, 8,000]
    answer_tokens_mean: int = 180  # exponential, clipped to [4, 1,500]

    def __post_init__(self) -> None:
        for name in ("duration_s", "requests_per_s", "bursts_per_s", "burst_s_mean"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if not self.burst_factor >= 1:
            raise ValueError(f"burst_factor must be >= 1, got {self.burst_factor}")
        low, high = self.system_tokens
        if self.system_prompts < 1 or not 0 <= low <= high:
            raise ValueError(f"bad system prompts: {self.system_prompts=} {self.system_tokens=}")


def bursty_short_trace(shape: BurstyShortShape | None = None) -> list[dict[str, Any]]:
    """The trace's records in arrival order."""
    shape = shape or BurstyShortShape()
    rng = random.Random(shape.seed)
    bursts: list[tuple[float, float]] = []
    at = 0.0
    while (at := at + rng.expovariate(shape.bursts_per_s)) < shape.duration_s:
        bursts.append((at, at + rng.expovariate(1.0 / shape.burst_s_mean)))
    systems = [rng.randint(*shape.system_tokens) for _ in range(shape.system_prompts)]
    weights = [1.0 / (i + 1) for i in range(shape.system_prompts)]
    peak = shape.requests_per_s * shape.burst_factor
    ids = _BlockIds()
    records = []
    t, index = 0.0, 0
    while (t := t + rng.expovariate(peak)) < shape.duration_s:  # thinned to the rate at t
        in_burst = any(start <= t < end for start, end in bursts)
        if not in_burst and rng.random() >= 1.0 / shape.burst_factor:
            continue
        system = rng.choices(range(shape.system_prompts), weights)[0]
        user = min(8_000, max(16, round(rng.lognormvariate(math.log(shape.user_tokens_median), 0.8))))
        prompt: list[Segment] = [(("system", system), systems[system]), (("user", index), user)]
        index += 1
        records.append(
            {
                "timestamp": round(t * 1000.0),
                "input_length": systems[system] + user,
                "output_length": min(1_500, max(4, round(rng.expovariate(1.0 / shape.answer_tokens_mean)))),
                "hash_ids": ids.of(prompt),
            }
        )
    return records


class _BlockIds:
    """Chained block ids: one per distinct (previous id, the block's segment pieces)."""

    def __init__(self) -> None:
        self._ids: dict[tuple[object, ...], int] = {}

    def of(self, segments: Sequence[Segment]) -> list[int]:
        ids: list[int] = []
        pieces: list[tuple[object, ...]] = []
        room = BLOCK_TOKENS
        for what, tokens in segments:
            start = 0
            while start < tokens:
                take = min(room, tokens - start)
                pieces.append((what, start, start + take))
                start += take
                room -= take
                if room == 0:
                    ids.append(self._id(ids, pieces))
                    pieces, room = [], BLOCK_TOKENS
        if pieces:
            ids.append(self._id(ids, pieces))
        return ids

    def _id(self, ids: list[int], pieces: list[tuple[object, ...]]) -> int:
        key = (ids[-1] if ids else -1, *pieces)
        return self._ids.setdefault(key, len(self._ids))


def long_prompt_trace(shape: LongPromptShape | None = None) -> list[dict[str, Any]]:
    """The trace's records in arrival order."""
    shape = shape or LongPromptShape()
    rng = random.Random(shape.seed)
    doc_tokens = [
        min(64_000, max(1_000, round(rng.lognormvariate(math.log(shape.document_tokens_median), 0.6))))
        for _ in range(shape.documents)
    ]
    doc_weights = [1.0 / (i + 1) ** shape.document_zipf for i in range(shape.documents)]
    ids = _BlockIds()
    system: Segment = (("system",), shape.system_tokens)
    rows: list[tuple[float, int, int, list[Segment]]] = []  # arrival ms, session, output, prompt
    start_s, session = 0.0, 0
    while True:
        start_s += rng.expovariate(shape.sessions_per_s)
        if start_s > shape.duration_s:
            break
        doc = rng.choices(range(shape.documents), doc_weights)[0]
        history: list[Segment] = [system, (("document", doc), doc_tokens[doc])]
        turns = 1 + math.floor(math.log(rng.random()) / math.log(1.0 - 1.0 / shape.turns_mean))
        at_s = start_s
        for turn in range(turns):
            if at_s > shape.duration_s:
                break
            history.append((("question", session, turn), rng.randint(*shape.question_tokens)))
            answer = min(2_000, max(16, round(rng.expovariate(1.0 / shape.answer_tokens_mean))))
            rows.append((at_s * 1000.0, session, answer, list(history)))
            history.append((("answer", session, turn), answer))
            at_s += answer * shape.decode_step_s + rng.expovariate(1.0 / shape.think_s_mean)
        session += 1
    rows.sort(key=lambda row: (row[0], row[1]))
    return [
        {
            "timestamp": round(at_ms),
            "input_length": sum(tokens for _, tokens in prompt),
            "output_length": output,
            "hash_ids": ids.of(prompt),
        }
        for at_ms, _, output, prompt in rows
    ]


def write_trace(path: Path, records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Write ``records`` as JSONL; the trace's figures (requests, mean prompt, span, load)."""
    if not records:
        raise ValueError("the trace holds no requests")
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    tokens = sum(r["input_length"] for r in records)
    span_s = max(records[-1]["timestamp"] / 1000.0, 1e-9)
    return {
        "requests": len(records),
        "mean_input_length": tokens / len(records),
        "mean_output_length": sum(r["output_length"] for r in records) / len(records),
        "span_s": span_s,
        "prompt_tokens_per_s": tokens / span_s,
        "distinct_blocks": len({h for r in records for h in r["hash_ids"]}),
    }
