"""OpenAI's completions and chat completions, as pydantic models, and their conversion to the
:class:`GenerateSpec` the gRPC edge builds: the same tokenisation (``Tokenizer.encode`` of the
text, or the token ids as given), the same :class:`SamplingParams` and the same checks, so a
seeded request gives the same tokens on either edge.

Fields this server implements: ``model``, ``prompt`` (one string or one list of token ids),
``messages``, ``max_tokens`` / ``max_completion_tokens``, ``temperature``, ``top_p``, ``seed``,
``presence_penalty``, ``frequency_penalty``, ``n`` and ``best_of``, ``stop`` (stop strings, matched
on the detokenised text: ``frontend/stop_cut.py``), ``stream``, ``stream_options.include_usage``
and vLLM's ``stream_options.continuous_usage_stats`` (the usage so far on every chunk), and
vLLM's extensions ``top_k``, ``min_p``, ``repetition_penalty``, ``stop_token_ids``,
``ignore_eos`` and ``return_token_ids``. Structured outputs (``openai_structured``): ``response_format``
(``json_object``, ``json_schema``) and vLLM's ``structured_outputs`` (a schema, a regex, an
EBNF grammar, a choice of strings). Logprobs (``openai_logprobs``): completions'
``logprobs: k`` and ``echo`` (the prompt's text and, with ``logprobs``, its tokens' logprobs;
``max_tokens: 0`` with ``echo`` returns the prompt alone), chat's ``logprobs`` and
``top_logprobs``; ``k`` is at most ``MAX_LOGPROBS`` (20, vLLM's default bound); ``logit_bias``
(token ids in the vocabulary, biases in [-100, 100], added before the penalties). OpenAI's
fields that do not change the output are checked and otherwise ignored: ``user``, ``store``
(nothing is stored), ``metadata`` (at most 16 string pairs), ``service_tier`` (one tier) and
``parallel_tool_calls``. A field OpenAI defines that would change the output but is
not implemented is refused when set, and so is any field OpenAI
does not define: :class:`OpenAIError` 400 naming it in ``param`` (a nested one by its path:
``stream_options.made_up``, ``messages.0.made_up``). Responses' ``usage`` carries one field
OpenAI does not define, ``prompt_tokens_details.cached_tokens_by_tier`` (``openai_shapes.usage``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from tandem.frontend.cache_salt import check_cache_salt
from tandem.frontend.chat_template import ChatTemplate
from tandem.frontend.grpc_auth import ANONYMOUS
from tandem.frontend.openai_structured import GuideError, ResponseFormat, StructuredOutputs, guide_of
from tandem.frontend.openai_tools import (
    Tool,
    ToolCall,
    ToolChoice,
    ToolPlan,
    plan_tools,
    tools_text,
)
from tandem.frontend.request_checks import check_ids_fit, check_text_fits, checked_sampling, stop_token_ids
from tandem.frontend.running import GenerateSpec
from tandem.model.tokenizer import Tokenizer
from tandem.wire.request_params import (
    MAX_LOGPROBS,
    MAX_SEED,
    InvalidRequestError,
    SamplingParams,
    check_prompt,
)

MAX_CHOICES = 16  # n and best_of at most
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for completions; chat's is the room left
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_METADATA_PAIRS, MAX_METADATA_KEY_CHARS, MAX_METADATA_VALUE_CHARS = 16, 64, 512  # OpenAI's
# OpenAI's fields that change what the client gets and are not implemented here: refused when
# set to anything but the value that means "off"
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "suffix": (None,),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "reasoning_effort": (None,),
    "web_search_options": (None,),
}


class OpenAIError(Exception):
    """An error in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self, status: int, message: str, type: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.counted = False  # True: the request ran, and its end is counted already

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    @staticmethod
    def invalid(param: str | None, message: str, status: int = 400) -> OpenAIError:
        shown = f"{param}: {message}" if param else message
        return OpenAIError(status, shown, "invalid_request_error", param)

    @staticmethod
    def model_not_found(asked: str, served: str) -> OpenAIError:
        return OpenAIError(
            404,
            f"The model {asked[:64]!r} does not exist; this server serves {served!r}",
            "invalid_request_error",
            "model",
            "model_not_found",
        )

    @staticmethod
    def from_invalid(exc: InvalidRequestError, field_names: dict[str, str] | None = None) -> OpenAIError:
        """An engine check's error (``sampling.max_tokens``) on this API's field (``max_tokens``)."""
        field = exc.field.removeprefix("sampling.")
        field = (field_names or {}).get(field, field)
        return OpenAIError.invalid(field, exc.message)


# ---- requests -------------------------------------------------------------------------------
class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: the usage so far on every chunk


class _GenerateRequest(_Strict):
    """What completions and chat completions share."""

    model: str
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # vLLM's; -1 or 0 disables
    seed: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None  # vLLM's
    ignore_eos: bool = False  # vLLM's
    return_token_ids: bool = False  # vLLM's: each choice carries its token ids
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's
    min_p: float | None = None  # vLLM's
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    user: str | None = None
    cache_salt: str | None = None  # vLLM's: only requests with the same salt share cached prefixes
    # OpenAI's, that do not change the output: checked, then ignored
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] | None = None
    parallel_tool_calls: bool | None = None
    suffix: Any = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    tools: Any = None
    tool_choice: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None  # vLLM's: a regex, a grammar, a choice...
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None


class CompletionRequest(_GenerateRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None  # each token's and its k likeliest (legacy shape)
    echo: bool | None = None  # the prompt before the completion, in the text and the logprobs
    best_of: int | None = None  # candidates drawn; the n of highest cumulative logprob returned


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool's result: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatRequest(_GenerateRequest):
    messages: list[ChatMessage]
    tools: list[Tool] | None = None  # implemented here (openai_tools)
    tool_choice: ToolChoice | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None  # with logprobs: the k likeliest of each output token
    echo: Any = None  # vLLM's (the last message echoed): not implemented


RequestT = TypeVar("RequestT", CompletionRequest, ChatRequest)
T = TypeVar("T")


def parse_request(model: type[RequestT], body: Any) -> RequestT:
    """The request ``body`` (parsed JSON) as ``model``; a field it gets wrong -> 400 naming it."""
    if not isinstance(body, dict):
        raise OpenAIError.invalid(None, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        raise _validation_error(exc) from None


def _validation_error(exc: ValidationError) -> OpenAIError:
    errors = exc.errors()
    # an unknown field, by its full path (a union's other members fail on it too: it wins)
    unknown = next((e for e in errors if e["type"] == "extra_forbidden"), None)
    if unknown is not None:
        *within, name = unknown["loc"]  # the unknown key itself is kept whatever it is
        kept = [part for part in within if isinstance(part, int) or _is_field_name(part)]
        path = ".".join(str(part) for part in (*kept, name))
        return OpenAIError.invalid(path or None, "unknown field: this server does not know it")
    error = errors[0]
    loc = list(error["loc"])
    param = str(loc[0]) if loc else None
    # messages.2.content: the message and its field; a union's member tags ("str", ...) are left out
    if param == "messages" and len(loc) > 1 and isinstance(loc[1], int):
        param += f".{loc[1]}"
        if len(loc) > 2 and loc[2] in ChatMessage.model_fields:
            param += f".{loc[2]}"
    if error["type"] == "missing":
        return OpenAIError.invalid(param, "is required")
    return OpenAIError.invalid(param, error["msg"])


def _is_field_name(part: object) -> bool:
    """A location's part that names a field, not a union member's tag (``str``, ``list[int]``,
    ``function-after[...]``): a client's key is kept whatever it is, since it is the last part."""
    return isinstance(part, str) and part.isidentifier() and part not in _UNION_TAGS


_UNION_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


# ---- conversion -----------------------------------------------------------------------------
@dataclass(frozen=True)
class ServedModel:
    """What the conversion needs to know of the served model."""

    name: str
    tokenizer: Tokenizer
    vocab_size: int
    context_tokens: int
    chat_template: ChatTemplate | None


@dataclass(frozen=True)
class Prepared:
    """A request converted: what the frontend runs, and what only this edge does with it."""

    spec: GenerateSpec
    stop: tuple[str, ...]  # stop strings, matched on the text here
    stream: bool
    include_usage: bool
    return_token_ids: bool
    continuous_usage: bool = False  # the usage so far on every streamed chunk
    logprobs: bool = False  # each output token's logprobs in the response
    echo: str | None = None  # the prompt's text, returned before the completion's
    prompt_only: bool = False  # max_tokens 0 with echo: one token is computed, none returned
    n: int = 1  # choices returned
    best_of: int = 1  # requests run (>= n): the n of highest cumulative logprob are returned
    guide_field: str = ""  # the field the request's guide came from (its compile errors name it)
    tool_calls: bool = False  # the output's tool calls are parsed out of its text

    def choice(self, index: int) -> Prepared:
        """Choice ``index``'s request of a request for several: its own id and its seed, the
        request's plus ``index`` (``choice_seed``); choices after the first fork from it
        (``GenerateSpec.fork_of``)."""
        spec, sampling = self.spec, self.spec.sampling
        assert sampling.seed is not None  # the request's, or drawn for it (``_prepared``)
        child = dataclasses.replace(sampling, seed=choice_seed(sampling.seed, index))
        fork_of = f"{spec.request_id}-0" if index else ""  # the first's prompt KV, on its decode rank
        spec = dataclasses.replace(
            spec, request_id=f"{spec.request_id}-{index}", sampling=child, fork_of=fork_of
        )
        return dataclasses.replace(self, spec=spec)


def choice_seed(seed: int, index: int) -> int:
    """The seed of choice ``index`` of a request seeded ``seed``: ``seed + index`` (wrapping at
    ``MAX_SEED``), so choice 0 is the request sent alone and choice ``i`` the request sent with
    that seed."""
    return (seed + index) % (MAX_SEED + 1)


def prepare_completion(
    request: CompletionRequest,
    model: ServedModel,
    request_id: str,
    client: str = ANONYMOUS,
    arrival_s: float | None = None,
) -> Prepared:
    _check_common(request, model)
    prompt = request.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise OpenAIError.invalid(
                "prompt", f"holds {len(prompt)} prompts; this server takes one a request (send each alone)"
            )
        prompt = prompt[0]
    if isinstance(prompt, str):
        context = model.context_tokens
        if not prompt:
            raise OpenAIError.invalid("prompt", "is empty")
        _edge(check_text_fits, "prompt", len(prompt), context)
        token_ids = model.tokenizer.encode(prompt)
    else:
        _edge(check_ids_fit, "prompt", len(prompt), model.context_tokens)
        token_ids = list(prompt)  # type: ignore[arg-type]  # one prompt of token ids, by now
    k = _logprobs_count("logprobs", request.logprobs)
    echo = None
    if request.echo:
        echo = prompt if isinstance(prompt, str) else model.tokenizer.decode(token_ids)
    # lm-eval's loglikelihood shape: the prompt's logprobs with no output (max_tokens 0)
    prompt_only = bool(request.echo) and request.max_tokens == 0 and not request.max_completion_tokens
    logprobs = _Logprobs(k, k if request.echo else None, echo, prompt_only)
    n = request.n or 1
    best_of = n if request.best_of is None else request.best_of
    if not n <= best_of <= MAX_CHOICES:
        raise OpenAIError.invalid("best_of", f"must be in [n = {n}, {MAX_CHOICES}], got {best_of}")
    if best_of > n and request.stream:
        raise OpenAIError.invalid("best_of", "cannot be streamed (the best are known at the end)")
    prepared = _prepared(
        request, model, token_ids, "prompt", COMPLETION_MAX_TOKENS, request_id, client, arrival_s, logprobs
    )
    if best_of > n and prepared.spec.sampling.logprobs is None:  # scored by their logprobs
        sampling = dataclasses.replace(prepared.spec.sampling, logprobs=0)
        prepared = dataclasses.replace(prepared, spec=dataclasses.replace(prepared.spec, sampling=sampling))
    return dataclasses.replace(prepared, best_of=best_of)


def prepare_chat(
    request: ChatRequest,
    model: ServedModel,
    request_id: str,
    client: str = ANONYMOUS,
    arrival_s: float | None = None,
    room_tokens: int | None = None,
) -> Prepared:
    """``room_tokens``: what one request may hold at most (the context, or less where a decode
    rank holds less); without ``max_tokens`` a chat request may generate up to it."""
    _check_common(request, model)
    if model.chat_template is None:
        raise OpenAIError.invalid(
            "messages",
            f"model {model.name!r} has no chat template (tokenizer_config.json chat_template); "
            "use /v1/completions",
        )
    if not request.messages:
        raise OpenAIError.invalid("messages", "is empty")
    try:
        tools = plan_tools(request.tools, request.tool_choice, request.parallel_tool_calls)
    except GuideError as exc:
        raise OpenAIError.invalid(exc.field, exc.message) from None
    messages = [_message(m) for m in request.messages]
    if tools is not None and not model.chat_template.renders_tools:
        messages.insert(0, {"role": "system", "content": tools_text(tools.tools)})
    total_chars = sum(len(m["content"]) for m in messages) + sum(len(str(t)) for t in tools_of(tools))
    _edge(check_text_fits, "messages", total_chars, model.context_tokens)
    try:
        token_ids = model.chat_template.prompt_token_ids(
            messages, model.tokenizer, tools.tools if tools is not None else None
        )
    except InvalidRequestError as exc:
        raise OpenAIError.from_invalid(exc) from None
    room = min(model.context_tokens, room_tokens or model.context_tokens)
    default = max(1, room - len(token_ids))
    if request.echo not in (None, False):
        raise OpenAIError.invalid("echo", "is not supported on chat completions; leave it out")
    if request.top_logprobs is not None and not request.logprobs:
        raise OpenAIError.invalid("top_logprobs", "needs logprobs: true")
    k = _logprobs_count("top_logprobs", request.top_logprobs or 0) if request.logprobs else None
    logprobs = _Logprobs(k, None, None, False)
    prepared = _prepared(
        request, model, token_ids, "messages", default, request_id, client, arrival_s, logprobs, tools
    )
    return dataclasses.replace(prepared, tool_calls=tools is not None and tools.parse)


def tools_of(plan: ToolPlan | None) -> list[dict[str, Any]]:
    return plan.tools if plan is not None else []


def _message(message: ChatMessage) -> dict[str, Any]:
    """A message as the chat template reads it: its text, and an assistant's calls or the call a
    tool's result answers."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.name:
        out["name"] = message.name
    if message.tool_calls:
        out["tool_calls"] = [c.model_dump() for c in message.tool_calls]
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.role == "tool" and message.tool_call_id is None:
        raise OpenAIError.invalid("messages", "a tool message needs tool_call_id (the call it answers)")
    return out


@dataclass(frozen=True)
class _Logprobs:
    """What a request asks of logprobs: the alternatives for each output token and each prompt
    token (``None``: none), the echoed prompt's text, and whether only the prompt is returned."""

    output: int | None
    prompt: int | None
    echo: str | None
    prompt_only: bool


def _logprobs_count(field: str, value: int | None) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise OpenAIError.invalid(field, f"must be in [0, {MAX_LOGPROBS}], got {value}")
    return value


def _check_common(request: _GenerateRequest, model: ServedModel) -> None:
    if request.model != model.name:
        raise OpenAIError.model_not_found(request.model, model.name)
    for name, off in UNSUPPORTED.items():
        if name in ("tools", "tool_choice") and isinstance(request, ChatRequest):
            continue  # the chat API's (openai_tools)
        value = getattr(request, name)
        if not any(value == o and type(value) is type(o) for o in off):
            raise OpenAIError.invalid(name, "is not supported by this server; leave it out")
    if request.n is not None and not 1 <= request.n <= MAX_CHOICES:
        raise OpenAIError.invalid("n", f"must be in [1, {MAX_CHOICES}], got {request.n}")
    if request.stream_options is not None and not request.stream:
        raise OpenAIError.invalid("stream_options", "only applies with stream: true")
    _check_metadata(request.metadata)
    if request.cache_salt is not None:
        _edge(check_cache_salt, request.cache_salt)


def _check_metadata(metadata: dict[str, str] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > MAX_METADATA_PAIRS:
        raise OpenAIError.invalid("metadata", f"{len(metadata)} pairs; at most {MAX_METADATA_PAIRS}")
    for key, value in metadata.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise OpenAIError.invalid(
                "metadata", f"a key of {len(key)} characters; at most {MAX_METADATA_KEY_CHARS}"
            )
        if len(value) > MAX_METADATA_VALUE_CHARS:
            raise OpenAIError.invalid(
                f"metadata.{key}", f"{len(value)} characters; at most {MAX_METADATA_VALUE_CHARS}"
            )


def _prepared(
    request: _GenerateRequest,
    model: ServedModel,
    token_ids: list[int],
    prompt_field: str,
    default_max_tokens: int,
    request_id: str,
    client: str,
    arrival_s: float | None,
    logprobs: _Logprobs,
    tools: ToolPlan | None = None,
) -> Prepared:
    max_tokens, max_field = _max_tokens(request, default_max_tokens)
    if logprobs.prompt_only:
        max_tokens = 1  # the first token is computed with the prompt's logits; none is returned
    sampling = _sampling(request, model.vocab_size, max_tokens, max_field)
    sampling = dataclasses.replace(sampling, logprobs=logprobs.output, prompt_logprobs=logprobs.prompt)
    try:
        guide, guide_field = guide_of(request.response_format, request.structured_outputs)
    except GuideError as exc:
        raise OpenAIError.invalid(exc.field, exc.message) from None
    if tools is not None and tools.guide is not None:
        if guide is not None:
            raise OpenAIError.invalid(
                "tool_choice", f"a call it requires cannot be combined with {guide_field}"
            )
        guide, guide_field = tools.guide, "tools"
    sampling = dataclasses.replace(sampling, guide=guide)
    context = model.context_tokens
    if not token_ids:
        raise OpenAIError.invalid(prompt_field, "is empty")
    try:
        check_prompt(token_ids, model.vocab_size, context, field=prompt_field)
    except InvalidRequestError as exc:
        raise OpenAIError.invalid(prompt_field, exc.message) from None
    if sampling.max_tokens > context - len(token_ids):
        raise OpenAIError.invalid(
            max_field,
            f"{sampling.max_tokens} with a prompt of {len(token_ids)} tokens passes the context of "
            f"{context} tokens: at most {context - len(token_ids)}",
        )
    if (request.n or 1) > 1 or getattr(request, "best_of", None):
        sampling = sampling.seeded()  # its choices' seeds follow from it
    spec = GenerateSpec(request_id, token_ids, sampling, client=client, cache_salt=request.cache_salt)
    if arrival_s is not None:
        spec = dataclasses.replace(spec, arrival_s=arrival_s)
    options = request.stream_options
    return Prepared(
        spec,
        _stop_strings(request.stop),
        bool(request.stream),
        options is not None and options.include_usage,
        request.return_token_ids,
        options is not None and options.continuous_usage_stats,
        logprobs.output is not None,
        logprobs.echo,
        logprobs.prompt_only,
        request.n or 1,
        request.n or 1,
        guide_field,
    )


def _max_tokens(request: _GenerateRequest, default: int) -> tuple[int, str]:
    """The output cap and the field it came from."""
    given, completion = request.max_tokens, request.max_completion_tokens
    if given is not None and completion is not None and given != completion:
        raise OpenAIError.invalid(
            "max_completion_tokens", f"{completion} differs from max_tokens {given}; give one of them"
        )
    if completion is not None:
        return completion, "max_completion_tokens"
    return (given, "max_tokens") if given is not None else (default, "max_tokens")


def _sampling(request: _GenerateRequest, vocab_size: int, max_tokens: int, max_field: str) -> SamplingParams:
    stops = _edge(stop_token_ids, "stop_token_ids", request.stop_token_ids or [], vocab_size)
    top_k = request.top_k if request.top_k is not None else 0
    sampling = SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else float(request.temperature),
        top_p=1.0 if request.top_p is None else float(request.top_p),
        top_k=0 if top_k == -1 else top_k,
        seed=request.seed,
        stop_token_ids=stops,
        ignore_eos=request.ignore_eos,
        presence_penalty=float(request.presence_penalty or 0.0),
        frequency_penalty=float(request.frequency_penalty or 0.0),
        repetition_penalty=1.0 if request.repetition_penalty is None else float(request.repetition_penalty),
        min_p=float(request.min_p or 0.0),
        logit_bias=_logit_bias(request.logit_bias),
    )
    try:
        return checked_sampling(sampling, vocab_size=vocab_size)
    except InvalidRequestError as exc:
        raise OpenAIError.from_invalid(exc, {"max_tokens": max_field}) from None


def _logit_bias(given: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """OpenAI's map of token ids (as strings) to biases, as sorted pairs (checked further by
    ``SamplingParams.validate``)."""
    pairs = []
    for key, value in (given or {}).items():
        if not key.isdigit() or not key.isascii():
            raise OpenAIError.invalid("logit_bias", f"a key is a token id (digits), got {key[:32]!r}")
        pairs.append((int(key), float(value)))
    return tuple(sorted(pairs))


def _stop_strings(stop: str | list[str] | None) -> tuple[str, ...]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise OpenAIError.invalid("stop", f"{len(stops)} stop strings; at most {MAX_STOP_STRINGS}")
    for s in stops:
        if not s:
            raise OpenAIError.invalid("stop", "holds an empty string")
        if len(s) > MAX_STOP_CHARS:
            raise OpenAIError.invalid(
                "stop", f"a stop string of {len(s)} characters; at most {MAX_STOP_CHARS}"
            )
    return tuple(dict.fromkeys(stops))


def _edge(check: Callable[..., T], *args: Any) -> T:
    """A shared check (``request_checks``) with its refusal in this API's shape."""
    try:
        return check(*args)
    except InvalidRequestError as exc:
        raise OpenAIError.from_invalid(exc) from None
