"""The requests ``tandem bench serve`` sends: synthetic prompts with shared prefixes, real text
(``--prompts-file``), or a Mooncake trace's requests with token ids made from its hash ids (pure
Python, deterministic).

Text: request ``i`` of a point is prompt ``(i + point) % n`` of the file, sent as text (the
frontend tokenizes it with the model's tokenizer). Drafts and caches see real text: random
token ids make any drafter look useless and any cache look cold.

Synthetic: request ``i`` of a point is one of ``prefixes`` shared prefixes (``i % prefixes``) of
``shared_prefix_tokens`` tokens, then a suffix of its own up to ``prompt_tokens``. The prefixes
depend on the seed alone, so every point meets the same ones; the suffixes on the seed, the point
and ``i``.

Trace: each hash id stands for one block of ``block_tokens`` tokens, drawn from the seed and the
id alone, so requests that share a block share its tokens and the prefix cache sees what the
trace's users saw. A request of ``input_length`` tokens (512 a block in the trace) gets
``round(input_length * block_tokens / 512)``: its full blocks whole, its last one cut. Sharing
is whole pages when ``block_tokens`` is a multiple of the page size. A request that does not
fit the context (prompt plus output) is clipped: the output to ``context_tokens - 1``, then the
prompt to what is left, and counted.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from tandem.bench.router_bench import BLOCK_TOKENS, TraceRequest


@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int]
    max_tokens: int
    send_at_s: float = 0.0  # from the start of the replay (open loop); 0 in a closed loop
    clipped: bool = False
    text: str | None = None  # sent as text instead of ``prompt`` (a text workload)


@dataclass(frozen=True)
class TextWorkload:
    """Prompts of real text, in turn; ``output_tokens`` each."""

    prompts: tuple[str, ...]
    output_tokens: int

    def check(self) -> None:
        if not self.prompts:
            raise ValueError("--prompts-file: holds no prompt")
        if self.output_tokens < 1:
            raise ValueError(f"--output-tokens: must be at least 1, got {self.output_tokens}")

    def request(self, point: int, index: int) -> BenchRequest:
        return BenchRequest([], self.output_tokens, text=self.prompts[(index + point) % len(self.prompts)])


@dataclass(frozen=True)
class SyntheticWorkload:
    prompt_tokens: int
    output_tokens: int
    shared_prefix_tokens: int
    prefixes: int
    vocab_size: int
    seed: int = 0

    def check(self) -> None:
        """An error names the flag."""
        for flag, value, low in (
            ("--prompt-tokens", self.prompt_tokens, 1),
            ("--output-tokens", self.output_tokens, 1),
            ("--shared-prefix-tokens", self.shared_prefix_tokens, 0),
            ("--prefixes", self.prefixes, 1),
            ("--vocab-size", self.vocab_size, 1),
        ):
            if value < low:
                raise ValueError(f"{flag}: must be at least {low}, got {value}")
        if self.shared_prefix_tokens > self.prompt_tokens:
            raise ValueError(
                f"--shared-prefix-tokens: {self.shared_prefix_tokens} is longer than --prompt-tokens "
                f"{self.prompt_tokens}"
            )

    def request(self, point: int, index: int) -> BenchRequest:
        prefix = _tokens(
            ("prefix", self.seed, index % self.prefixes), self.shared_prefix_tokens, self.vocab_size
        )
        suffix_tokens = self.prompt_tokens - self.shared_prefix_tokens
        suffix = _tokens(("suffix", self.seed, point, index), suffix_tokens, self.vocab_size)
        return BenchRequest(prefix + suffix, self.output_tokens)


def _tokens(key: tuple[object, ...], count: int, vocab_size: int) -> list[int]:
    rng = random.Random(repr(key))  # a str seed is hashed by SHA-512: the same across processes
    return [rng.randrange(vocab_size) for _ in range(count)]


def block_token_ids(hash_id: int, block_tokens: int, vocab_size: int, seed: int = 0) -> list[int]:
    """The tokens one trace block stands for: the same ``hash_id`` always gives the same ones."""
    return _tokens(("block", seed, hash_id), block_tokens, vocab_size)


@dataclass(frozen=True)
class TraceReplay:
    block_tokens: int = BLOCK_TOKENS
    time_scale: float = 1.0
    max_output_tokens: int | None = None
    context_tokens: int = 2048
    vocab_size: int = 256
    seed: int = 0

    def check(self) -> None:
        """An error names the flag."""
        if self.block_tokens < 1:
            raise ValueError(f"--block-tokens: must be at least 1, got {self.block_tokens}")
        if not self.time_scale > 0:
            raise ValueError(f"--time-scale: must be > 0, got {self.time_scale}")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise ValueError(f"--max-output-tokens: must be at least 1, got {self.max_output_tokens}")
        if self.context_tokens < 2:
            raise ValueError(f"--context-tokens: must be at least 2, got {self.context_tokens}")
        if self.vocab_size < 1:
            raise ValueError(f"--vocab-size: must be at least 1, got {self.vocab_size}")

    def requests(self, trace: list[TraceRequest]) -> list[BenchRequest]:
        """``trace`` (a slice, in arrival order) as requests sent from its first arrival on."""
        if not trace:
            return []
        start_s = trace[0].arrival_s
        return [self.request(r, (r.arrival_s - start_s) * self.time_scale) for r in trace]

    def request(self, entry: TraceRequest, send_at_s: float) -> BenchRequest:
        input_tokens = max(1, round(entry.input_length * self.block_tokens / BLOCK_TOKENS))
        output_tokens = max(1, entry.output_length)
        if self.max_output_tokens is not None:
            output_tokens = min(output_tokens, self.max_output_tokens)
        clipped = input_tokens + output_tokens > self.context_tokens
        if clipped:
            output_tokens = min(output_tokens, self.context_tokens - 1)
            input_tokens = self.context_tokens - output_tokens
        prompt: list[int] = []
        for hash_id in entry.hash_ids:
            if len(prompt) >= input_tokens:
                break
            prompt += block_token_ids(hash_id, self.block_tokens, self.vocab_size, self.seed)
        # a trace whose blocks fall short of its scaled length (rounding): pad from its last block
        if len(prompt) < input_tokens:
            pad = ("pad", self.seed, entry.hash_ids[-1:] or (0,), entry.input_length)
            prompt += _tokens(pad, input_tokens - len(prompt), self.vocab_size)
        return BenchRequest(prompt[:input_tokens], output_tokens, send_at_s, clipped)
