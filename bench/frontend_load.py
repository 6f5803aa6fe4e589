"""gRPC streaming clients for the frontend benchmark, run in a process of their own (no Ray, no
torch) so that their CPU is not the frontend's.

:func:`run_round` opens ``streams`` ``Generate`` calls at once over open connections
(``grpc.aio``), stream ``i`` with the workload's prompt ``i`` of the round
(``bench/frontend_workload.py``), each asking for ``output_tokens`` tokens, and checks every
stream as it ends: its tokens are the workload's output for its prompt, in order; every chunk
starts at the next output index with a timing per token; the chunks' text joined and the
summary's text are the tokenizer's text of those tokens (decoded here, in one call). Prompts and
what to expect are made before the first call is sent. Wall time is read on this process's
monotonic clock, from the first call sent to the last summary received.

:func:`client_process` is the process's entry: it connects once, then waits for each round's
orders on a pipe (``None`` ends it) and answers with :class:`LoadResult`.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import grpc

from tandem.bench.frontend_workload import FrontendWorkload
from tandem.model.tokenizer import Tokenizer
from tandem.protos import tandem_pb2, tandem_pb2_grpc


@dataclass(frozen=True)
class LoadOrder:
    """One round: ``streams`` concurrent requests of ``output_tokens`` tokens each, with the
    workload's prompts of ``round_id``."""

    streams: int
    output_tokens: int
    round_id: str


@dataclass(frozen=True)
class _Expected:
    """One stream's prompt, and the tokens and text it must get back."""

    prompt_token_ids: tuple[int, ...]
    token_ids: list[int]
    text: str


@dataclass(frozen=True)
class LoadResult:
    """What the clients saw in one round."""

    streams: int
    completed: int  # streams whose tokens, order and text were all right
    tokens: int  # output tokens received over all streams
    messages: int  # GenerateResponse messages with a chunk
    wall_s: float  # first call sent -> last summary received
    cpu_s: float  # this process's CPU over the same interval
    errors: tuple[str, ...] = ()  # the first few streams that went wrong, and why
    # each completed stream's time to first token at the frontend (its summary's ttft_s), and
    # the client's own reading: call sent -> first chunk, on this process's clock
    frontend_ttft_s: tuple[float, ...] = ()
    client_ttft_s: tuple[float, ...] = ()


@dataclass
class _Seen:
    tokens: int = 0
    messages: int = 0
    error: str | None = None
    frontend_ttft_s: float = 0.0
    client_ttft_s: float = 0.0


async def _one_stream(stub: Any, order: LoadOrder, index: int, expected: _Expected) -> _Seen:
    """One ``Generate`` call: what the client saw, and what went wrong (``error``) if anything."""
    seen = _Seen()
    sent_s = time.monotonic()
    seen.error = await _check_stream(stub, order, index, expected, seen, sent_s)
    return seen


async def _check_stream(
    stub: Any, order: LoadOrder, index: int, expected: _Expected, seen: _Seen, sent_s: float
) -> str | None:
    sampling = tandem_pb2.SamplingParams(max_tokens=order.output_tokens, ignore_eos=True)
    request = tandem_pb2.GenerateRequest(request_id=f"{order.round_id}-{index}", sampling=sampling)
    request.token_ids.ids.extend(expected.prompt_token_ids)
    tokens: list[int] = []
    texts: list[str] = []
    messages, timing_index = 0, 0
    summary: Any = None
    async for response in stub.Generate(request):
        if response.HasField("chunk"):
            chunk = response.chunk
            if not messages:
                seen.client_ttft_s = time.monotonic() - sent_s
            messages += 1
            seen.tokens, seen.messages = seen.tokens + len(chunk.token_ids), messages
            tokens.extend(chunk.token_ids)
            texts.append(chunk.text)
            if chunk.first_index != timing_index:
                return f"chunk from output index {chunk.first_index}, expected {timing_index}"
            if not len(chunk.server_times_s) == len(chunk.gaps_s) == len(chunk.token_ids):
                return f"a chunk of {len(chunk.token_ids)} tokens with {len(chunk.gaps_s)} timings"
            timing_index += len(chunk.token_ids)
        else:
            summary = response.summary
    if summary is None:
        return "no summary"
    if summary.error:
        return f"error: {summary.error}"
    seen.frontend_ttft_s = summary.bill.latency.ttft_s
    want = expected.token_ids
    if tokens != want:
        wrong = next((i for i, (a, b) in enumerate(zip(tokens, want, strict=False)) if a != b), len(tokens))
        return f"{len(tokens)} tokens, first wrong at {wrong}"
    if list(summary.token_ids) != tokens:
        return "summary tokens differ from the streamed ones"
    if summary.text != expected.text:
        return f"the summary's text is not the tokens' text: {summary.text[:40]!r} for {expected.text[:40]!r}"
    streamed, want_text = "".join(texts), expected.text
    if streamed != want_text:
        pairs = enumerate(zip(streamed, want_text, strict=False))
        at = next((i for i, (a, b) in pairs if a != b), min(len(streamed), len(want_text)))
        return f"streamed text differs from the tokens' from character {at}: {streamed[at : at + 20]!r}"
    return None


def _expectations(workload: FrontendWorkload, tokenizer: Tokenizer, order: LoadOrder) -> list[_Expected]:
    out = []
    for index in range(order.streams):
        prompt = workload.prompt(order.round_id, index)
        tokens = list(workload.output_token_ids(prompt, order.output_tokens))
        out.append(_Expected(prompt, tokens, tokenizer.decode(tokens)))
    return out


async def run_round(
    stubs: list[Any], order: LoadOrder, workload: FrontendWorkload, tokenizer: Tokenizer
) -> LoadResult:
    """One round over open channels' stubs (stream ``i`` on stub ``i % len(stubs)``)."""
    expected = _expectations(workload, tokenizer, order)
    start, cpu_start = time.monotonic(), time.process_time()
    outcomes = await asyncio.gather(
        *(_one_stream(stubs[i % len(stubs)], order, i, expected[i]) for i in range(order.streams)),
        return_exceptions=True,
    )
    wall_s, cpu_s = time.monotonic() - start, time.process_time() - cpu_start
    tokens = messages = completed = 0
    errors: list[str] = []
    frontend_ttft: list[float] = []
    client_ttft: list[float] = []
    for i, outcome in enumerate(outcomes):
        if isinstance(outcome, BaseException):
            errors.append(f"stream {i}: {type(outcome).__name__}: {outcome}")
            continue
        tokens, messages = tokens + outcome.tokens, messages + outcome.messages
        if outcome.error is None:
            completed += 1
            frontend_ttft.append(outcome.frontend_ttft_s)
            client_ttft.append(outcome.client_ttft_s)
        else:
            errors.append(f"stream {i}: {outcome.error}")
    return LoadResult(
        order.streams,
        completed,
        tokens,
        messages,
        wall_s,
        cpu_s,
        tuple(errors[:5]),
        tuple(frontend_ttft),
        tuple(client_ttft),
    )


async def _serve_orders(address: str, workload: FrontendWorkload, channels: int, pipe: Any) -> None:
    tokenizer = Tokenizer.from_dir(workload.model_dir)
    chans = [grpc.aio.insecure_channel(address) for _ in range(channels)]
    try:
        for chan in chans:
            await asyncio.wait_for(chan.channel_ready(), timeout=30)
        stubs = [tandem_pb2_grpc.TandemStub(chan) for chan in chans]
        pipe.send("ready")
        while True:
            order = await asyncio.to_thread(pipe.recv)
            if order is None:
                return
            pipe.send(await run_round(stubs, order, workload, tokenizer))
    finally:
        for chan in chans:
            await chan.close()


def client_process(address: str, workload: FrontendWorkload, channels: int, pipe: Any) -> None:
    """The clients' process: connects ``channels`` channels, says ``"ready"``, then answers each
    :class:`LoadOrder` read from ``pipe`` with a :class:`LoadResult`, until ``None``."""
    asyncio.run(_serve_orders(address, workload, channels, pipe))
