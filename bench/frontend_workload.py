"""What the frontend benchmark sends and streams (``bench/host_frontend.py``): each request's
prompt, and the output tokens its fake decode rank makes (``bench/fake_ranks.py``) and its client
checks (``bench/frontend_load.py``). No Ray, no torch: the clients' process imports it.

Both workloads are a stream corpus of token ids and a rule for prompts and outputs::

    stream_token_ids   [ english ........ | other languages ... | code ... ]   (wraps around)
    prompt(round, i)   prefixes[i % len(prefixes)] + a suffix of the corpus: its length and its
                       start drawn from (round, i), so every round sends new prompts
    output of prompt   stream_token_ids[(start + k) % len] for k = 0, 1, ...; start is the
                       character start that the prompt's hash picks: a function of the prompt,
                       as a model's greedy output is, and a passage of its own for every stream

``realistic``: the bench tokenizer's 100,000 ids (``bench/bench_tokenizer.py``); the corpus is
the King James Bible, the first lines of every other-language text found (vim's tutors, GnuPG's
help: characters of two to four bytes, which a byte-level tokenizer splits across tokens) and of
some Python modules; prompts of 1,024 to 4,096 tokens, one of four "system prompt" prefixes of 512
to 2,048 tokens (whole 64-token pages) then a suffix of at least 256 tokens of their own.

``easy``: the case measured before: the demo tokenizer's 258 ids, every prompt the same 32 tokens
(no full page: nothing to hash), every stream the same cyclic list of :data:`SAMPLE_TEXT`'s
tokens from its start, so the frontend's detokeniser caches hit almost always.
"""

from __future__ import annotations

import random
import statistics
import zlib
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from tandem.bench.bench_tokenizer import (
    BenchModelDir,
    Text,
    TextKind,
    bench_model_dir,
    demo_dir,
    read_texts,
    token_bytes,
)
from tandem.model.tokenizer import TOKENIZER_FILE, Tokenizer

WORKLOADS = ("realistic", "easy")
# the easy workload's stream: English with a few multi-byte characters
SAMPLE_TEXT = (
    "In the beginning the frontend took every token the decode ranks pushed, turned it into text "
    "and sent it on \u2014 chunk after chunk, stream after stream \u2014 to clients near and far: "
    "caf\u00e9, na\u00efve, \u00fcber, \u6570\u636e. "
)
EASY_PROMPT_TOKENS = 32
PROMPT_TOKENS = (1024, 4096)  # realistic: least and most, before a long prefix's suffix adds to it
PREFIX_TOKENS = (512, 1024, 1536, 2048)  # the shared "system prompts", whole pages of 64 tokens
MIN_SUFFIX_TOKENS = 256
PASSAGE_CHARS = 3_000  # the first characters of each other-language or code text in the corpus
OTHER_CHARS = CODE_CHARS = 150_000  # of the corpus, beside the Bible's 360,000


@dataclass(frozen=True)
class FrontendWorkload:
    """Prompts and outputs of one workload (the module's docstring); ``facts`` describe it for
    the report. Every process that holds one makes the same prompts and the same outputs."""

    name: str
    model_dir: str
    vocab_size: int
    stream_token_ids: tuple[int, ...]
    character_starts: tuple[int, ...]  # positions in the stream where a character begins
    prefixes: tuple[tuple[int, ...], ...]
    prompt_tokens: tuple[int, int]
    min_suffix_tokens: int
    facts: dict[str, Any] = field(default_factory=dict)

    def prompt_parts(self, round_id: str, index: int) -> tuple[tuple[int, ...], int]:
        """Prompt ``index`` of round ``round_id``, and how many of its leading tokens are a shared
        prefix."""
        rng = random.Random(f"{round_id}/{index}")  # a str seed hashes the same in every process
        prefix = self.prefixes[index % len(self.prefixes)] if self.prefixes else ()
        least, most = self.prompt_tokens
        suffix = max(rng.randint(least, most) - len(prefix), self.min_suffix_tokens)
        return prefix + self._take(rng.choice(self.character_starts), suffix), len(prefix)

    def prompt(self, round_id: str, index: int) -> tuple[int, ...]:
        return self.prompt_parts(round_id, index)[0]

    def output_start(self, prompt: Sequence[int]) -> int:
        """Where in the stream the output of ``prompt`` starts."""
        starts = self.character_starts
        return starts[zlib.crc32(array("q", prompt).tobytes()) % len(starts)]

    def output_token_ids(self, prompt: Sequence[int], count: int) -> tuple[int, ...]:
        return self._take(self.output_start(prompt), count)

    def _take(self, start: int, count: int) -> tuple[int, ...]:
        tokens = self.stream_token_ids
        out = tokens[start : start + count]
        while len(out) < count:
            out += tokens[: count - len(out)]
        return out


def build_workload(name: str) -> FrontendWorkload:
    if name == "realistic":
        return realistic_workload()
    if name == "easy":
        return easy_workload()
    raise ValueError(f"workload: expected one of {', '.join(WORKLOADS)}, got {name!r}")


def easy_workload(model_dir: Path | None = None) -> FrontendWorkload:
    model_dir = model_dir or demo_dir()
    tokenizer = Tokenizer.from_dir(model_dir)
    special = {tokenizer.bos_token_id, tokenizer.eos_token_id}
    tokens = tuple(t for t in tokenizer.encode(SAMPLE_TEXT) if t not in special)
    facts = {"stream_tokens": len(tokens), "shared_prefix_tokens": []}
    length = (EASY_PROMPT_TOKENS, EASY_PROMPT_TOKENS)
    return FrontendWorkload("easy", str(model_dir), tokenizer.vocab_size, tokens, (0,), (), length, 1, facts)


def realistic_workload() -> FrontendWorkload:
    texts = read_texts()
    model = bench_model_dir(texts)
    tokenizer = Tokenizer.from_dir(model.path)
    backend = HFTokenizer.from_file(str(model.path / TOKENIZER_FILE))  # to encode without BOS
    by_kind: dict[TextKind, list[int]] = {}
    for kind, passage in _passages(texts):
        by_kind.setdefault(kind, []).extend(backend.encode(passage, add_special_tokens=False).ids)
    stream = tuple(t for kind in TextKind for t in by_kind.get(kind, ()))
    raw = token_bytes(backend)
    # an output starts on a character's first byte, as a model's does after its prompt
    starts = tuple(i for i, t in enumerate(stream) if raw[t] and not 0x80 <= raw[t][0] < 0xC0)
    rng = random.Random("tandem-bench-prefixes")
    prefixes = tuple(stream[s : s + n] for s, n in ((rng.choice(starts[:-4096]), n) for n in PREFIX_TOKENS))
    facts = {
        "tokenizer": _tokenizer_facts(model),
        "stream_tokens": len(stream),
        "stream_token_share": {k.value: round(len(by_kind.get(k, ())) / len(stream), 3) for k in TextKind},
        # tokens with a byte of a multi-byte character, and those that hold part of one only
        # (their text alone does not decode): the detokeniser holds those back
        "non_ascii_token_share": round(sum(max(raw[t], default=0) >= 0x80 for t in stream) / len(stream), 3),
        "split_character_token_share": round(sum(not _whole(raw[t]) for t in stream) / len(stream), 3),
        "shared_prefix_tokens": [len(p) for p in prefixes],
    }
    return FrontendWorkload(
        "realistic",
        str(model.path),
        tokenizer.vocab_size,
        stream,
        starts,
        prefixes,
        PROMPT_TOKENS,
        MIN_SUFFIX_TOKENS,
        facts,
    )


def _passages(texts: list[Text]) -> list[tuple[TextKind, str]]:
    """The stream corpus's texts: every English one whole; then ``PASSAGE_CHARS`` from the middle
    of each other-language text, those with the most multi-byte characters first (a few are
    English placeholders), up to ``OTHER_CHARS``; then of code, spread evenly over the files, up to
    ``CODE_CHARS``."""
    out: list[tuple[TextKind, str]] = [(t.kind, t.text) for t in texts if t.kind is TextKind.ENGLISH]
    other = list({t.text: t for t in texts if t.kind is TextKind.OTHER}.values())  # no copies
    other.sort(key=lambda t: -sum(ord(c) > 127 for c in t.text) / len(t.text))
    if not other:  # nothing on this machine: the sample's few
        other = [Text(TextKind.OTHER, "", SAMPLE_TEXT * 8)]
    code = [t for t in texts if t.kind is TextKind.CODE]
    code = code[:: max(1, len(code) * PASSAGE_CHARS // CODE_CHARS)]
    for kind, chosen, budget in ((TextKind.OTHER, other, OTHER_CHARS), (TextKind.CODE, code, CODE_CHARS)):
        used = 0
        for text in chosen:
            middle = max(0, (len(text.text) - PASSAGE_CHARS) // 2) if kind is TextKind.OTHER else 0
            window = text.text[middle : middle + PASSAGE_CHARS]
            lines = window.split("\n")
            head = "\n".join(lines[1:-1]) if len(lines) > 2 else window  # whole lines
            if used + len(head) > budget:
                break
            out.append((kind, head + "\n"))
            used += len(head)
    return out


def _whole(raw: bytes) -> bool:
    try:
        raw.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _tokenizer_facts(model: BenchModelDir) -> dict[str, Any]:
    return {
        "vocab_size": model.vocab_size,
        "train_s": model.train_s,
        "trained_chars": model.trained_chars,
        "texts": model.texts,
        "digest": model.digest,
        "cached": model.cached,
        "dir": str(model.path),
    }


def prompt_facts(workload: FrontendWorkload, round_ids: Sequence[tuple[str, int]]) -> dict[str, Any]:
    """Prompt lengths and the shared prefixes' share of their tokens over rounds of
    ``(round_id, streams)``."""
    lengths: list[int] = []
    shared = 0
    for round_id, streams in round_ids:
        for index in range(streams):
            prompt, prefix = workload.prompt_parts(round_id, index)
            lengths.append(len(prompt))
            shared += prefix
    if not lengths:
        return {}
    return {
        "prompt_tokens": {
            "min": min(lengths),
            "p50": int(statistics.median(lengths)),
            "max": max(lengths),
            "mean": round(statistics.fmean(lengths), 1),
        },
        "shared_prefix_share": round(shared / sum(lengths), 3),
    }
