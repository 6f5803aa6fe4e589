"""The OpenAI edge's answers to an admitted request: the whole response (``scored_response``,
with its cumulative logprob for ``best_of``) or its server-sent events (``sse_events``), and
several choices merged (``best_of_choices``, ``merged_events``). Every field derived from a
stream is cut where a stop string cuts its text (``frontend/stop_cut.py``): token ids,
logprobs, usage; a tool call cut short ends as ``length`` with its text kept."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from tandem.frontend.core import FrontendCore
from tandem.frontend.openai_logprobs import TokenNames, chat_logprobs, completion_logprobs
from tandem.frontend.openai_protocol import OpenAIError, Prepared
from tandem.frontend.openai_shapes import ResponseShape, finish_reason, usage
from tandem.frontend.openai_tools import CallStream, parse_calls
from tandem.frontend.request_stream import StreamChunk
from tandem.frontend.stop_cut import Released, StopCut
from tandem.wire.logprobs import TokenLogprobs
from tandem.wire.messages import Bill
from tandem.wire.request_params import FinishReason
from tandem.wire.stream_summary import StreamSummary

STOP_ABORT_WAIT_S = 30.0  # for the rank's report of a request a stop string ended


def best_of_choices(prepared: Prepared, scored: list[tuple[dict[str, Any], float]]) -> dict[str, Any]:
    """One response of the choices' (``best_of`` > ``n``: the ``n`` of highest cumulative
    logprob, in that order): the prompt counted once, the completion tokens of every request
    run (OpenAI bills ``best_of``'s candidates too)."""
    order = list(range(len(scored)))
    if prepared.best_of > prepared.n:
        order = sorted(order, key=lambda i: -scored[i][1])[: prepared.n]
    choices = []
    for index, i in enumerate(order):
        choice = {**scored[i][0]["choices"][0], "index": index}
        if not prepared.logprobs:
            choice["logprobs"] = None  # computed to score the candidates, not asked for
        choices.append(choice)
    first = scored[0][0]
    return {**first, "choices": choices, "usage": usage_of_choices([body["usage"] for body, _ in scored])}


def usage_of_choices(used: list[dict[str, Any]]) -> dict[str, Any]:
    """The usage of a request for several choices: its prompt once (the first choice's, whose
    prompt was computed first), every choice's completion tokens."""
    total = dict(used[0])
    completion = sum(u["completion_tokens"] for u in used)
    details = [u["completion_tokens_details"] for u in used]
    total["completion_tokens"] = completion
    total["total_tokens"] = total["prompt_tokens"] + completion
    total["completion_tokens_details"] = {k: sum(d[k] for d in details) for k in details[0]}
    return total


async def merged_events(
    streams: list[Callable[[list[dict[str, Any]]], AsyncIterator[bytes]]],
    prepared: Prepared,
    shape: ResponseShape,
) -> AsyncIterator[bytes]:
    """The choices' events as each comes, then the usage of all (when asked) and ``[DONE]``."""
    queue: asyncio.Queue[bytes | None] = asyncio.Queue()
    tails: list[dict[str, Any]] = []

    async def pump(events: AsyncIterator[bytes]) -> None:
        try:
            async for event in events:
                await queue.put(event)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(stream(tails))) for stream in streams]
    try:
        ended = 0
        while ended < len(tasks):
            event = await queue.get()
            if event is None:
                ended += 1
            else:
                yield event
        for task in tasks:
            task.result()  # a choice's stream that raised fails the response
    finally:
        for task in tasks:
            task.cancel()
    if prepared.include_usage and tails:
        yield sse_event(shape.usage_chunk(usage_of_choices(tails)))
    yield b"data: [DONE]\n\n"


def sse_event(data: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def stopped_summary(
    core: FrontendCore, prepared: Prepared, items: AsyncIterator[Any]
) -> StreamSummary | None:
    """A stop string ended the request: abort it on its decode rank (its pages are freed) and
    wait for the rank's report, whose bill the usage reads; ``None`` if none comes in time."""
    spec = prepared.spec
    core.abort(spec.request_id, spec.client)

    async def summary() -> StreamSummary | None:
        async for item in items:
            if isinstance(item, StreamSummary):
                return item
        return None

    try:
        return await asyncio.wait_for(summary(), STOP_ABORT_WAIT_S)
    except TimeoutError:
        return None


def error_body(summary: StreamSummary) -> dict[str, Any]:
    message = summary.error or "the request failed on the ranks"
    return OpenAIError(503, message, "service_unavailable", None, "request_failed").body()


@dataclass(frozen=True)
class Answer:
    """One admitted choice as the edge answers it: the request's items (``first`` already
    taken), the response's shape, and what names its tokens."""

    core: FrontendCore
    prepared: Prepared
    shape: ResponseShape
    items: AsyncIterator[Any]
    first: Any
    names: TokenNames


class _Events:
    """What one choice's events have sent so far: completion tokens (none past a stop string),
    the text offset of the next token (completions' logprobs), the stop strings' and the tool
    calls' held-back text."""

    def __init__(self, answer: Answer) -> None:
        self.answer, self.prepared, self.shape = answer, answer.prepared, answer.shape
        self.stopper = StopCut(self.prepared.stop, answer.core.detokenizer_cache)
        self.calls = CallStream() if self.prepared.tool_calls else None
        self.ids = self.prepared.return_token_ids
        self.prompt_tokens, self.completion_tokens = len(self.prepared.spec.prompt_token_ids), 0
        self.offset = 0

    def event(self, body: dict[str, Any], bill: Bill | None = None) -> bytes:
        """With ``continuous_usage_stats`` every chunk carries the usage so far (the last one
        the bill's, as the usage chunk does)."""
        if self.prepared.continuous_usage:
            prompt, completion = self.prompt_tokens, self.completion_tokens
            body["usage"] = (
                usage(prompt, completion, bill)
                if bill is not None
                else {
                    "prompt_tokens": prompt,
                    "completion_tokens": completion,
                    "total_tokens": prompt + completion,
                }
            )
        return sse_event(body)

    def usage(self, bill: Bill) -> dict[str, Any]:
        return usage(self.prompt_tokens, self.completion_tokens, bill)

    def opening(self) -> list[bytes]:
        """The chat's role chunk; an echoed prompt, with its logprobs when asked (they came
        with the first tokens)."""
        shape, prepared = self.shape, self.prepared
        empty: list[int] | None = [] if self.ids else None
        out = [self.event(shape.chunk(shape.choice("", None, empty, first=True)))] if shape.chat else []
        if prepared.echo is not None:
            entries = self.answer.first.prompt_logprobs  # a chunk's or the summary's
            body = logprobs_body(self.answer.names, prepared, False, [], [], entries, 0, with_prompt=True)
            self.offset = sum(len(t) for t in body["tokens"]) if body else 0
            out.append(self.event(shape.chunk(shape.choice(prepared.echo, None, empty, logprobs=body))))
        return out

    def _logprobs(self, released: Released) -> dict[str, Any] | None:
        body = logprobs_body(
            self.answer.names, self.prepared, self.shape.chat, released.token_ids, released.logprobs,
            text_offset=self.offset,
        )  # fmt: skip
        if body is not None and "tokens" in body:
            self.offset += sum(len(t) for t in body["tokens"])
        return body

    def chunk(self, item: StreamChunk) -> list[bytes]:
        """A chunk's text, token ids and logprobs, as far as the stop strings release them, and
        the tool calls it completes."""
        shape, out = self.shape, []
        released = self.stopper.feed(item.token_ids, item.text, item.logprobs)
        self.completion_tokens += len(released.token_ids)
        text, called = released.text, list[dict[str, Any]]()
        if self.calls is not None:
            text, called = self.calls.feed(text)
        body = self._logprobs(released)
        if text or (self.ids and released.token_ids) or (body is not None and released.token_ids):
            token_ids = released.token_ids if self.ids else None
            out.append(self.event(shape.chunk(shape.choice(text, None, token_ids, logprobs=body))))
        if called:
            out.append(self.event(shape.chunk(shape.calls_choice(called))))
        return out

    def stopped(self, summary: StreamSummary | None) -> bytes:
        """The last chunk once a stop string matched (``summary``: the rank's report, if it came)."""
        seed = summary.bill.seed if summary is not None else None
        bill = summary.bill if summary is not None else Bill()
        rest = self.calls.finish() if self.calls is not None else ""
        finish = with_calls("stop", self.calls is not None and self.calls.calls > 0)
        return self.event(
            self.shape.chunk(self.shape.choice(rest, finish, [] if self.ids else None), seed), bill
        )

    def ended(self, summary: StreamSummary) -> list[bytes]:
        """The last chunk once the rank ended the request: what the stop strings held back (the
        last tokens, their text and logprobs; a stop string in the text an incomplete character
        ended with cuts it too), the tool calls it completes, the finish reason."""
        shape, out = self.shape, []
        released = self.stopper.finish()
        self.completion_tokens += len(released.token_ids)
        finish = "stop" if self.stopper.stopped else finish_reason(summary.finish_reason, False)
        rest = released.text
        if self.calls is not None:
            rest, called = self.calls.feed(rest)
            if called:
                out.append(self.event(shape.chunk(shape.calls_choice(called))))
            rest += self.calls.finish(cut=finish != "stop")
            finish = with_calls(finish, self.calls.calls > 0)
        body = self._logprobs(released) if released.token_ids else None
        token_ids = released.token_ids if self.ids else None
        choice = shape.choice(rest, finish, token_ids, logprobs=body)
        out.append(self.event(shape.chunk(choice, summary.bill.seed), summary.bill))
        return out


async def sse_events(answer: Answer, tail: list[dict[str, Any]] | None = None) -> AsyncIterator[bytes]:
    """The response's server-sent events: a chunk per piece of text, the last with the finish
    reason, the usage when asked for, then ``[DONE]`` (``_Events`` says what each holds). With
    ``tail`` (one choice of several), the usage is put there instead of sent, and no ``[DONE]``
    ends the events: the choices' merged stream sends them."""
    events = _Events(answer)
    for event in events.opening():
        yield event
    item, summary = answer.first, None
    while True:
        if isinstance(item, StreamChunk):
            if not answer.prepared.prompt_only:  # else its one computed token is not the client's
                for event in events.chunk(item):
                    yield event
                if events.stopper.stopped:
                    summary = await stopped_summary(answer.core, answer.prepared, answer.items)
                    yield events.stopped(summary)
                    break
        else:
            summary = item
            if summary.finish_reason == FinishReason.ERROR:
                yield sse_event(error_body(summary))
                if tail is None:
                    yield b"data: [DONE]\n\n"
                return
            for event in events.ended(summary):
                yield event
            break
        item = await anext(answer.items)
    bill = summary.bill if summary is not None else Bill()
    if tail is not None:
        tail.append(events.usage(bill))
        return
    if answer.prepared.include_usage:
        yield sse_event(answer.shape.usage_chunk(events.usage(bill)))
    yield b"data: [DONE]\n\n"


async def scored_response(answer: Answer) -> tuple[dict[str, Any], float]:
    """The whole response, once the request has ended, and its tokens' cumulative logprob (0
    when none were computed)."""
    core, prepared, shape, names = answer.core, answer.prepared, answer.shape, answer.names
    items, first = answer.items, answer.first
    stopper = StopCut(prepared.stop, core.detokenizer_cache)
    text: list[str] = []
    token_ids: list[int] = []
    entries: list[TokenLogprobs | None] = []
    item: Any = first
    prompt_entries = item.prompt_logprobs if isinstance(item, StreamChunk) else ()

    def take(released: Released) -> None:
        text.append(released.text)
        token_ids.extend(released.token_ids)
        entries.extend(released.logprobs)

    while isinstance(item, StreamChunk):
        take(stopper.feed(item.token_ids, item.text, item.logprobs))
        if stopper.stopped:
            break
        item = await anext(items)
    if stopper.stopped:
        summary = await stopped_summary(core, prepared, items)
        finish = "stop"
    else:
        summary = item
        if summary.finish_reason == FinishReason.ERROR:
            body = error_body(summary)["error"]
            failed = OpenAIError(503, body["message"], body["type"], None, body["code"])
            failed.counted = True  # the frontend counted the request's end
            raise failed
        take(stopper.finish())  # a stop string in an incomplete character's U+FFFD cuts too
        finish = "stop" if stopper.stopped else finish_reason(summary.finish_reason, False)
    bill = summary.bill if summary is not None else Bill()
    if summary is not None and not prompt_entries:
        prompt_entries = summary.prompt_logprobs
    if prepared.prompt_only:  # its one computed token is not the client's
        text, token_ids, entries = [], [], []
    logprobs = logprobs_body(names, prepared, shape.chat, token_ids, entries, prompt_entries)
    used = usage(len(prepared.spec.prompt_token_ids), len(token_ids), bill)
    ids = token_ids if prepared.return_token_ids else None
    content: str | None = (prepared.echo or "") + "".join(text)
    calls: list[dict[str, Any]] = []
    if prepared.tool_calls:
        content, calls = parse_calls(content or "", cut=finish != "stop")
        finish = with_calls(finish, bool(calls))
    body = shape.response(content, finish, ids, used, bill.seed, logprobs, calls or None)
    return body, sum(e.logprob for e in entries if e is not None)


def with_calls(finish: str, called: bool) -> str:
    """The finish reason of an output with ``called`` complete tool calls: ``tool_calls`` only
    when the model ended it (``stop``); one cut short (``length``, ``abort``) keeps its reason,
    and the call it was cut in is returned as content (``parse_calls``, ``CallStream.finish``)."""
    return "tool_calls" if called and finish == "stop" else finish


def logprobs_body(
    names: TokenNames,
    prepared: Prepared,
    chat: bool,
    token_ids: list[int],
    entries: list[TokenLogprobs | None],
    prompt_entries: Sequence[TokenLogprobs | None] = (),
    text_offset: int = 0,
    with_prompt: bool = False,
) -> dict[str, Any] | None:
    """A choice's ``logprobs`` for ``token_ids`` (``None`` when the request asked for none);
    an echoed completion's begin with the prompt's (``with_prompt``: a stream's first event)."""
    if not prepared.logprobs:
        return None
    if chat:
        return chat_logprobs(names, token_ids, entries)
    ids, all_entries = list(token_ids), list(entries)
    if prepared.echo is not None and (with_prompt or not prepared.stream):
        prompt = prepared.spec.prompt_token_ids
        given = list(prompt_entries)[: len(prompt)]
        ids, all_entries = prompt + ids, given + [None] * (len(prompt) - len(given)) + all_entries
    return completion_logprobs(names, ids, all_entries, text_offset)
