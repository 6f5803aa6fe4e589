"""What a request asks of its ranks, and the checks every process makes of it: the sampling
parameters (a greedy temperature, a seed), why a request ended, and the one error of bad input,
which names the field. Every edge and every rank checks with these, so one rule holds end to end."""

from __future__ import annotations

import dataclasses
import enum
import math
import secrets
from dataclasses import dataclass


class FinishReason(enum.StrEnum):
    """Why a request ended; the one definition every rank, the frontend and the API use."""

    STOP = "stop"  # an end-of-sequence or stop token
    LENGTH = "length"  # max_tokens, or the context is full
    ABORT = "abort"  # the client or the operator ended it
    ERROR = "error"  # something failed; the result's ``error`` says what


class InvalidRequestError(ValueError):
    """Bad user input; ``field`` names what was wrong."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:  # crosses process boundaries intact
        return (type(self), (self.field, self.message))


def check_prompt(
    prompt_token_ids: list[int], vocab_size: int, max_model_len: int, field: str = "prompt_ids"
) -> None:
    """Reject an empty prompt, a token id outside the vocabulary, or a prompt that leaves no room
    for one generated token; the error names the field."""
    if not prompt_token_ids:
        raise InvalidRequestError("prompt", "is empty")
    bad = [t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequestError(field, f"token id {bad[0]!r} is outside the vocabulary [0, {vocab_size})")
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequestError("prompt", context_overflow(len(prompt_token_ids), max_model_len))


def context_overflow(prompt_tokens: int, context: int) -> str:
    """Why a prompt of ``prompt_tokens`` does not fit ``context``, in the one wording every check uses."""
    return (
        f"{prompt_tokens} tokens do not fit the context of {context} tokens "
        "(the prompt plus at least one generated token)"
    )


MAX_SEED = 2**63 - 1  # seeds travel as int64 tensors

# A temperature below this is greedy (vLLM's bound too): float32 logits divided by a smaller one
# overflow to +-inf, and the draw is then no longer the argmax it tends to
GREEDY_TEMPERATURE = 1e-5


def draw_seed() -> int:
    """A fresh 63-bit seed from the OS, for a request that brought none."""
    return secrets.randbits(63)


MAX_LOGPROBS = 20  # likeliest alternatives a position may ask for (OpenAI's bound)

MAX_LOGIT_BIAS, MAX_BIAS = 1024, 100.0  # entries of logit_bias, and OpenAI's bound on each

MAX_PENALTY = 2.0  # OpenAI's bound on presence_penalty and frequency_penalty, either sign

MAX_GUIDE_CHARS = 64 * 1024  # a schema's, a regex's or a grammar's text at most


class GuideKind(enum.StrEnum):
    """What a structured output's ``Guide.spec`` is."""

    JSON_OBJECT = "json_object"  # any JSON object (no spec)
    JSON_SCHEMA = "json_schema"  # a JSON Schema, as JSON text
    REGEX = "regex"
    GRAMMAR = "grammar"  # EBNF (xgrammar's dialect, GBNF-like), its root rule ``root``
    STRUCTURAL_TAG = "structural_tag"  # xgrammar's structural tag, as JSON text (tool calls)


@dataclass(frozen=True)
class Guide:
    """A structured output: every token sampled is one the grammar allows after the tokens
    before it (``model/grammar``), and EOS only once the grammar is complete. A JSON schema or
    object is generated in its compact form (no whitespace between tokens)."""

    kind: GuideKind
    spec: str = ""

    def validate(self, field: str = "guide") -> None:
        """The shape only; whether the spec compiles is the edge's check (``model/grammar``)."""
        if not isinstance(self.kind, GuideKind):
            raise InvalidRequestError(
                field, f"unknown kind {self.kind!r}; one of {[k.value for k in GuideKind]}"
            )
        if not isinstance(self.spec, str) or len(self.spec) > MAX_GUIDE_CHARS:
            size = len(self.spec) if isinstance(self.spec, str) else type(self.spec).__name__
            raise InvalidRequestError(field, f"a spec of {size} characters; at most {MAX_GUIDE_CHARS}")
        if self.kind is not GuideKind.JSON_OBJECT and not self.spec:
            raise InvalidRequestError(field, f"a {self.kind.value} guide needs its spec")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling. A temperature below ``GREEDY_TEMPERATURE`` (0 included) is greedy;
    ``top_k == 0`` disables top-k; ``min_p`` drops the tokens less likely than ``min_p`` times
    the likeliest (0 disables).

    Penalties change the logits before anything else, greedy requests too, in vLLM's order:
    ``repetition_penalty`` (``r``) divides a positive logit by ``r`` and multiplies a negative one,
    for every token of the prompt and of the output so far; then OpenAI's ``frequency_penalty``
    times the token's count in the output so far, and ``presence_penalty`` once if it is there
    at all, are subtracted. Their neutral values (0, 0, 1) change nothing.

    With a ``seed`` the tokens depend only on the seed and the logits, never on the batch: the
    random draw for output token ``i`` is keyed by ``(seed, i)``.

    ``logit_bias``: (token id, bias) pairs added to those tokens' logits before anything else
    (the penalties included, as vLLM does), each bias in [-100, 100]: -100 all but bans a token,
    100 all but forces it.

    ``logprobs``: each output token's log-probability and that many likeliest alternatives (0 to
    ``MAX_LOGPROBS``; ``None``: none); ``prompt_logprobs`` the same for each prompt token after
    the first. Both are the model's log-softmax before any adjustment above (``wire/logprobs``).
    A prompt's logprobs need the logits of every prompt position, which a cached prefix does not
    keep: such a request computes its whole prompt (its bill shows no cached tokens).

    ``guide``: a structured output (:class:`Guide`), its mask applied after the penalties and
    before the temperature and filters; logprobs stay the model's own (before the mask).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()
    guide: Guide | None = None

    def validate(self, vocab_size: int | None = None) -> None:
        """Raise ``InvalidRequestError`` naming the first field that is wrong; with
        ``vocab_size``, a token id outside the vocabulary too."""
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise InvalidRequestError("max_tokens", f"must be a positive integer, got {self.max_tokens!r}")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidRequestError("temperature", f"must be >= 0, got {self.temperature!r}")
        if not math.isfinite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError("top_k", f"must be an integer >= 0 (0 disables), got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed <= MAX_SEED):
            raise InvalidRequestError("seed", f"must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not math.isfinite(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidRequestError(
                    name, f"must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value!r}"
                )
        if not math.isfinite(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise InvalidRequestError(
                "repetition_penalty", f"must be > 0 (1 disables), got {self.repetition_penalty!r}"
            )
        if not math.isfinite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1] (0 disables), got {self.min_p!r}")
        self._validate_logit_bias(vocab_size)
        if self.guide is not None:
            if not isinstance(self.guide, Guide):
                raise InvalidRequestError("guide", f"must be a Guide, got {type(self.guide).__name__}")
            self.guide.validate()
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (
                not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_LOGPROBS
            ):
                raise InvalidRequestError(
                    name, f"must be an integer in [0, {MAX_LOGPROBS}] (or unset), got {value!r}"
                )

    def _validate_logit_bias(self, vocab_size: int | None) -> None:
        bias = self.logit_bias
        if not isinstance(bias, tuple) or len(bias) > MAX_LOGIT_BIAS:
            count = len(bias) if isinstance(bias, tuple) else type(bias).__name__
            raise InvalidRequestError(
                "logit_bias", f"{count} entries; at most {MAX_LOGIT_BIAS} (token id, bias) pairs"
            )
        seen: set[int] = set()
        for pair in bias:
            token, value = pair if isinstance(pair, tuple) and len(pair) == 2 else (None, None)
            if not isinstance(token, int) or isinstance(token, bool) or token < 0:
                raise InvalidRequestError("logit_bias", f"a token id is an integer >= 0, got {token!r}")
            if vocab_size is not None and token >= vocab_size:
                raise InvalidRequestError(
                    "logit_bias", f"token id {token} is outside the vocabulary [0, {vocab_size})"
                )
            if token in seen:
                raise InvalidRequestError("logit_bias", f"token id {token} is given twice")
            seen.add(token)
            if not isinstance(value, int | float) or not math.isfinite(value) or abs(value) > MAX_BIAS:
                raise InvalidRequestError(
                    "logit_bias", f"token {token}: a bias is in [-{MAX_BIAS:g}, {MAX_BIAS:g}], got {value!r}"
                )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def penalized(self) -> bool:
        """Whether a penalty applies: the sampler then needs the request's tokens so far."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def needs_history(self) -> bool:
        """Whether the sampler needs the request's tokens so far: for its penalties, or for its
        guide's state (rebuilt from them on whichever rank samples)."""
        return self.penalized or self.guide is not None

    def seeded(self) -> SamplingParams:
        """The same sampling with a seed: its own, or a fresh one (``draw_seed``). Every draw of a
        request is keyed by its seed, so one without would share every other's draws."""
        return self if self.seed is not None else dataclasses.replace(self, seed=draw_seed())

    def canonical(self) -> SamplingParams:
        """The same sampling with a greedy temperature written as 0, as the edges pass it on."""
        return dataclasses.replace(self, temperature=0.0) if self.greedy and self.temperature else self


def max_kv_pages(prompt_tokens: int, max_tokens: int, max_model_len: int, page_size: int) -> int:
    """Pages a request holds at its longest. The last sampled token's KV is never computed,
    hence the - 1."""
    return math.ceil((min(prompt_tokens + max_tokens, max_model_len) - 1) / page_size)
