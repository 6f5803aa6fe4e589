"""A prefill worker and a decode worker joined by real NIXL transfers, in one process: the
disaggregated path gives the colocated engine's tokens, reuses prefixes, and survives a decode
pool too small for all requests at once, with every page accounted for at the end. The bill's
transfer figures are measured where the transfer happens: a known delay injected into NIXL's
completion shows up in them, and layer-wise writes hide behind a known compute time; with ready
events that complete behind the host (a GPU's), each layer's writes leave while the forward still
runs, and the compute figure ends at the last layer's completion."""

from __future__ import annotations

import dataclasses
import json
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.bench.gpu_transfer_check import DirectDispatcher as _Direct
from tandem.decode.decode_request import Routing
from tandem.decode.scheduler import DecodeScheduler
from tandem.decode.types import DecodeSchedulerConfig
from tandem.decode.worker import DecodeWorker
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.engine.rank_context import guided_rows
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.kvtransfer.metadata import InMemoryMetadataStore
from tandem.kvtransfer.nixl_transport import NixlTransport
from tandem.model.checkpoint import load_checkpoint
from tandem.model.config import ModelConfig
from tandem.model.deepseek import DeepseekV3
from tandem.model.kv_pool import KVPool
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.model.tokenizer import Tokenizer
from tandem.prefill.scheduler import PrefillScheduler, PrefillSchedulerConfig
from tandem.prefill.worker import PrefillWorker
from tandem.wire.messages import LoopStats, PrefillAttempt, RankId, RequestResult
from tandem.wire.prefill_job import PrefillJob
from tandem.wire.request_params import Guide, GuideKind, InvalidRequestError, SamplingParams
from tests.kvtransfer.transfer_doubles import CountingAgent, HeldEvent, HeldWrites, hold, wait_until

PAGE = 8
PREFILL, DECODE = RankId("prefill", 0), RankId("decode", 0)


def _model(path: Path) -> DeepseekV3:
    cfg = ModelConfig.from_dir(path)
    model = DeepseekV3(cfg, torch.float64)
    model.load_weights(load_checkpoint(path, cfg, torch.float64))
    return model


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread, as a rank runs (``cluster/rank_setup.py``): two threads beside the two
    NIXL agents' UCX threads oversubscribe a two-core machine, and a forward of a few
    milliseconds then stalls for more than a second now and then, which the timing tests
    would read as transfer time."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("disagg") / "tiny", seed=0)


class _DelayedCompletion:
    """The sender's NIXL agent, with each transfer reported complete no sooner than ``delay_s``
    after it was posted (as a slower link would); everything else is the real agent."""

    def __init__(self, agent: Any, delay_s: float) -> None:
        self._agent, self.delay_s = agent, delay_s
        self._posted: dict[int, float] = {}

    def transfer(self, handle: Any, *args: Any) -> Any:
        self._posted[id(handle)] = time.monotonic()
        return self._agent.transfer(handle, *args)

    def check_xfer_state(self, handle: Any) -> str:
        state = str(self._agent.check_xfer_state(handle))
        if state == "DONE" and time.monotonic() - self._posted[id(handle)] < self.delay_s:
            return "PROC"
        return state

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


class _RefusingAgent:
    """The sender's NIXL agent, refusing its first ``count`` writes as a failing NIC would."""

    def __init__(self, agent: Any, count: int) -> None:
        self._agent, self.left = agent, count

    def transfer(self, handle: Any, *args: Any) -> Any:
        if self.left > 0:
            self.left -= 1
            return "ERR"
        return self._agent.transfer(handle, *args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


class _FaultyAgent:
    """The sender's NIXL agent, failing its first ``count`` transfers in one way:
    ``completion`` (NIXL reports the write failed), ``state-raises`` (asking NIXL about the write
    raises), ``notify`` (the DONE notification cannot be sent), ``corrupt`` (the DONE
    notification arrives with a field of the wrong type), ``corrupt-count`` (it claims more
    cached tokens than the pages hold), ``corrupt-logprobs`` (its prompt logprobs hold a positive
    one), ``drop`` (it is lost on the way, silently),
    ``unreachable`` (the receiver's agent cannot be added).
    Everything else is the real agent."""

    def __init__(self, agent: Any, fault: str, count: int = 1) -> None:
        self._agent, self.fault, self.left = agent, fault, count
        self._failing: set[int] = set()

    def transfer(self, handle: Any, *args: Any) -> Any:
        if self.fault in ("completion", "state-raises") and self.left > 0:
            self.left -= 1
            self._failing.add(id(handle))
        return self._agent.transfer(handle, *args)

    def check_xfer_state(self, handle: Any) -> str:
        state = str(self._agent.check_xfer_state(handle))
        if id(handle) in self._failing and state == "DONE":
            if self.fault == "state-raises":
                raise RuntimeError("NIXL_ERR_BACKEND")
            return "ERR"
        return state

    def send_notif(self, agent_name: str, message: bytes) -> None:
        corrupting = self.fault in ("notify", "corrupt", "corrupt-count", "corrupt-logprobs", "drop")
        if corrupting and b'"kind": "done"' in message and self.left > 0:
            self.left -= 1
            if self.fault == "notify":
                raise RuntimeError("NIXL_ERR_NOT_FOUND")
            if self.fault == "drop":
                return
            if self.fault == "corrupt":
                message = message.replace(b'"first_token": ', b'"first_token": "x", "was": ')
            elif self.fault == "corrupt-logprobs":
                message = message.replace(b'"prompt": [null', b'"prompt": [[5, 0.5, []], null')
            else:
                message = message.replace(b'"cached_tokens": ', b'"cached_tokens": 1000000, "was": ')
        self._agent.send_notif(agent_name, message)

    def add_remote_agent(self, metadata: bytes) -> Any:
        if self.fault == "unreachable" and self.left > 0:
            self.left -= 1
            raise RuntimeError("NIXL_ERR_BACKEND: no route")
        return self._agent.add_remote_agent(metadata)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


def _slow_attention(model: DeepseekV3, seconds: float) -> None:
    """Each layer's attention (which writes its KV) takes ``seconds`` longer: known compute."""
    for layer in model.layers:
        layer.self_attn.register_forward_pre_hook(lambda module, args: time.sleep(seconds))


def _workers(
    tiny: Path,
    decode_pages: int,
    layerwise: bool,
    completion_delay_s: float = 0.0,
    attention_delay_s: float = 0.0,
    refuse_writes: int = 0,
    fault: str | None = None,
    kv_timeout_s: float = 30.0,
    abort_grace_s: float = 5.0,
    guided: bool = False,
) -> tuple[PrefillWorker, DecodeWorker]:
    store = InMemoryMetadataStore()
    p_model, d_model = _model(tiny), _model(tiny)
    if attention_delay_s:
        _slow_attention(p_model, attention_delay_s)
    cfg = p_model.cfg
    p_pool = KVPool(cfg, 64, PAGE, torch.float64)
    d_pool = KVPool(cfg, decode_pages, PAGE, torch.float64)
    prefill = PrefillWorker(
        PREFILL,
        1,
        PrefillScheduler(
            PrefillSchedulerConfig(
                num_pages=64,
                page_size=PAGE,
                max_num_batched_tokens=64,
                max_model_len=512,
                vocab_size=cfg.vocab_size,
            )
        ),
        ModelRunner(p_model, p_pool, guides=guided_rows(str(tiny), cfg.vocab_size) if guided else None),
        NixlTransport(PREFILL.name, 1, p_pool.layout, store),
        layerwise=layerwise,
    )
    decode = DecodeWorker(
        DECODE,
        1,
        DecodeScheduler(DecodeSchedulerConfig(num_pages=decode_pages, page_size=PAGE, max_model_len=512)),
        ModelRunner(d_model, d_pool, guides=guided_rows(str(tiny), cfg.vocab_size) if guided else None),
        NixlTransport(DECODE.name, 1, d_pool.layout, store, abort_grace_s=abort_grace_s),
        _Direct(prefill),
        kv_timeout_s=kv_timeout_s,
    )
    transport = prefill.transport
    assert isinstance(transport, NixlTransport)
    if completion_delay_s:
        transport.agent = _DelayedCompletion(transport.agent, completion_delay_s)
    if refuse_writes:
        transport.agent = _RefusingAgent(transport.agent, refuse_writes)
    if fault is not None:
        transport.agent = _FaultyAgent(transport.agent, fault)
    return prefill, decode


def _submit(decode: DecodeWorker, requests: list[Request]) -> None:
    decode.submit([(r, Routing(), time.monotonic()) for r in requests])


def _run(prefill: PrefillWorker, decode: DecodeWorker, requests: list[Request]) -> dict[str, RequestResult]:
    _submit(decode, requests)
    done = _drive(prefill, decode, until=len(requests), steps=10**7, timeout_s=60.0)
    assert len(done) == len(requests)
    return done


def _requests(prompts: list[list[int]], sampling: list[SamplingParams], tag: str) -> list[Request]:
    return [
        Request(f"{tag}{i}", p, s, frozenset({257}), 512)
        for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))
    ]


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole-request"])
def test_disaggregated_tokens_equal_the_colocated_engine(tiny: Path, layerwise: bool) -> None:
    rng = random.Random(0)
    system = [rng.randrange(256) for _ in range(20)]  # a shared prefix, as a chat's system prompt
    prompts = [system + [rng.randrange(256) for _ in range(rng.randrange(1, 30))] for _ in range(6)]
    prompts += [[rng.randrange(256)] for _ in range(2)]
    sampling = [
        SamplingParams(max_tokens=12, ignore_eos=True) if i % 2 else
        SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9, seed=100 + i, ignore_eos=True)
        for i in range(len(prompts))
    ]  # fmt: skip
    engine = ColocatedEngine(_model(tiny), EngineConfig(page_size=PAGE, num_pages=256))
    expected = [o.token_ids for o in engine.generate(prompts, sampling)]

    # a decode pool of 12 pages: requests wait for pages in its pre-allocation queue
    prefill, decode = _workers(tiny, decode_pages=12, layerwise=layerwise)
    first = _run(
        prefill, decode, _requests(prompts[:1], sampling[:1], "warm")
    )  # puts the prefix in the cache
    assert list(first["warm0"].token_ids) == expected[0]
    done = _run(prefill, decode, _requests(prompts, sampling, "r"))
    assert [list(done[f"r{i}"].token_ids) for i in range(len(prompts))] == expected
    for i in range(1, 6):  # the shared prefix came from the prefill rank's cache
        bill = done[f"r{i}"].bill
        # one attempt per reservation: the first, then one re-prefill per preemption, each billed
        assert len(bill.attempts) == bill.preemptions + 1 and all(a.delivered for a in bill.attempts)
        first = bill.attempts[0]
        assert first.prompt_tokens == bill.prompt_tokens == len(prompts[i]) and first.cached_tokens >= 16
        assert bill.cached_tokens == sum(a.cached_tokens for a in bill.attempts)
        assert bill.new_prompt_tokens == sum(a.prompt_tokens - a.cached_tokens for a in bill.attempts)
        assert bill.kv_bytes == sum(a.kv_bytes for a in bill.attempts)
        assert bill.kv_bytes > 0 and bill.first_token_s > 0
        assert len(bill.token_times_s) == bill.output_tokens == 12
        assert list(bill.token_times_s) == sorted(bill.token_times_s)
        assert bill.token_times_s[0] == bill.first_token_s
        assert done[f"r{i}"].prefill_rank == PREFILL and done[f"r{i}"].finish_reason == "length"
    decode.scheduler.check_integrity()
    prefill.scheduler.check_integrity()
    assert decode.scheduler.num_free_pages == 12
    assert prefill.scheduler.num_free_pages == 64
    assert prefill.transport.in_flight() == (0, 0) and decode.transport.in_flight() == (0, 0)
    prefill.transport.close()
    decode.transport.close()


def _drive(
    prefill: PrefillWorker, decode: DecodeWorker, until: int, steps: int = 3000, timeout_s: float = 60.0
) -> dict[str, RequestResult]:
    done: dict[str, RequestResult] = {}
    deadline = time.monotonic() + timeout_s
    for _ in range(steps):
        if time.monotonic() > deadline:
            break
        decode.tick()
        prefill.tick()
        if prefill.has_work():
            prefill.step()
        decode.step()
        done |= {r.request_id: r for r in decode.take_results()}
        if len(done) >= until and not prefill.pending() and decode.transport.in_flight() == (0, 0):
            break
    return done


def test_abort_at_every_stage_frees_every_page(tiny: Path) -> None:
    prefill, decode = _workers(tiny, decode_pages=8, layerwise=True)
    long = SamplingParams(max_tokens=24, ignore_eos=True)
    # "running" holds 5 of the 8 decode pages once it decodes; "queued" (4 pages) then waits
    _submit(decode, _requests([[7] * 40], [long], "running"))
    for _ in range(3000):
        _drive(prefill, decode, until=0, steps=1)
        if decode.scheduler.num_running:
            break
    assert decode.scheduler.num_running == 1 and decode.scheduler.num_free_pages < 4
    _submit(decode, _requests([[9] * 30], [long], "queued"))
    decode.tick()
    assert decode.scheduler.num_queued == 1
    decode.abort("queued0")  # waiting for pages
    decode.abort("running0")  # decoding
    # waiting for KV: the job was sent but the prefill rank has not started it
    _submit(decode, _requests([[5] * 12], [long], "kv"))
    decode.tick()
    assert decode.scheduler.num_waiting_for_kv == 1 and prefill.pending() == 1
    decode.abort("kv0")
    for _ in range(2000):  # the cancellation reaches the prefill rank before it steps again
        decode.tick()
        prefill.tick()
        if not prefill.pending():
            break
    done = _drive(prefill, decode, until=3)
    assert {r: done[r].finish_reason for r in ("queued0", "running0", "kv0")} == dict.fromkeys(
        ("queued0", "running0", "kv0"), "abort"
    )
    # the prefill rank dropped the job from its queue uncomputed: it never wrote into the pages
    # the decode rank gave up, and began no transfer for it
    assert prefill.cancelled_jobs == 1 and not prefill.failures
    assert ("recv", "aborted", 1) in decode.stats(LoopStats()).transfer_failures
    decode.scheduler.check_integrity()
    prefill.scheduler.check_integrity()
    assert decode.scheduler.num_free_pages == 8 and prefill.scheduler.num_free_pages == 64
    assert prefill.transport.in_flight() == (0, 0) and decode.transport.in_flight() == (0, 0)
    prefill.transport.close()
    decode.transport.close()


def _one_bill(prefill: PrefillWorker, decode: DecodeWorker, tag: str) -> PrefillAttempt:
    rng = random.Random(tag)
    prompt = [rng.randrange(256) for _ in range(40)]  # no prefix shared with others
    done = _run(prefill, decode, _requests([prompt], [SamplingParams(max_tokens=2, ignore_eos=True)], tag))
    bill = done[f"{tag}0"].bill
    assert len(bill.attempts) == 1 and bill.attempts[0].delivered
    return bill.attempts[0]


def _timed_bills(tiny: Path, layerwise: bool, **delays: float) -> list[PrefillAttempt]:
    """Five requests' attempts, after a first one that connects the two agents; UCX on a shared
    machine stalls now and then, so tests compare the quietest of five."""
    prefill, decode = _workers(tiny, decode_pages=32, layerwise=layerwise, **delays)
    _one_bill(prefill, decode, f"warm-{layerwise}-{delays}")
    out = [_one_bill(prefill, decode, f"timed-{layerwise}-{delays}-{i}") for i in range(5)]
    prefill.transport.close()
    decode.transport.close()
    return out


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole-request"])
def test_a_delay_in_the_write_completion_shows_in_transfer_and_exposed_time(
    tiny: Path, layerwise: bool
) -> None:
    """NIXL's completion of every write comes 500 ms late: the sender's transfer time and the
    exposed time both grow by that much, measured side by side with the same figures without
    the delay (prompts of the same length, none cached)."""
    delay = 0.5
    plain = _timed_bills(tiny, layerwise)
    slow = _timed_bills(tiny, layerwise, completion_delay_s=delay)
    for attempt in slow:  # every slow transfer shows the delay, on the sender and the receiver
        assert attempt.kv_transfer_s >= delay and attempt.kv_transfer_exposed_s >= delay
        assert attempt.kv_wait_s >= delay and attempt.kv_bytes == plain[0].kv_bytes > 0
    tolerance = 0.25  # polling and scheduling on a loaded machine
    for figure in ("kv_transfer_s", "kv_transfer_exposed_s"):
        quiet_plain = min(getattr(a, figure) for a in plain)
        quiet_slow = min(getattr(a, figure) for a in slow)
        # and only that much: the quietest slow figure is the quietest plain one plus the delay
        assert quiet_plain < delay and quiet_slow <= quiet_plain + delay + tolerance, figure


def test_layerwise_writes_hide_behind_compute(tiny: Path) -> None:
    """Each layer's attention takes 40 ms more: layer-wise writes overlap the later layers, so the
    transfer spans the forward while its exposed part (last layer computed -> KV usable) is a
    small fraction of it; whole-request writes start after the forward and are all exposed."""
    layerwise = _timed_bills(tiny, True, attention_delay_s=0.04)
    whole = _timed_bills(tiny, False, attention_delay_s=0.04)
    for attempt in layerwise + whole:
        assert attempt.prefill_compute_s >= 3 * 0.04  # three layers
    for attempt in layerwise:
        assert attempt.kv_transfer_s >= 2 * 0.04  # first layer's post -> last layer's completion
    assert min(a.kv_transfer_exposed_s / a.kv_transfer_s for a in layerwise) < 0.25
    for attempt in whole:
        assert attempt.kv_transfer_exposed_s >= attempt.kv_transfer_s


def test_a_refused_write_fails_that_attempt_alone_and_the_retry_delivers(tiny: Path) -> None:
    """NIXL refuses the first write: the prefill rank keeps stepping, the decode rank retries the
    request, and its bill lists the failed attempt with its error beside the delivered one."""
    prefill, decode = _workers(tiny, decode_pages=32, layerwise=True, refuse_writes=1)
    rng = random.Random(11)
    prompt = [rng.randrange(256) for _ in range(30)]
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    done = _run(prefill, decode, _requests([prompt], [sampling], "refused"))
    result = done["refused0"]
    engine = ColocatedEngine(_model(tiny), EngineConfig(page_size=PAGE, num_pages=64))
    assert list(result.token_ids) == engine.generate([prompt], [sampling])[0].token_ids
    failed, delivered = result.bill.attempts
    assert not failed.delivered and "refused" in (failed.error or "") and failed.kv_bytes == 0
    assert delivered.delivered and delivered.attempt == failed.attempt + 1
    # the failed attempt bills nothing; the retry found what the first computed in the cache
    assert result.bill.cached_tokens + result.bill.new_prompt_tokens == len(prompt) == delivered.prompt_tokens
    assert result.bill.kv_bytes == delivered.kv_bytes > 0
    assert ("send", "error", 1) in prefill.stats(LoopStats()).transfer_failures
    decode.scheduler.check_integrity()
    prefill.scheduler.check_integrity()
    assert decode.scheduler.num_free_pages == 32 and prefill.transport.in_flight() == (0, 0)
    prefill.transport.close()
    decode.transport.close()


@pytest.mark.parametrize(
    "fault",
    [
        "completion",
        "state-raises",
        "notify",
        "corrupt",
        "corrupt-count",
        "corrupt-logprobs",
        "drop",
        "unreachable",
    ],
)
def test_a_transfer_fault_fails_that_attempt_alone_and_the_retry_delivers(tiny: Path, fault: str) -> None:
    """Each way a transfer can fail on the wire fails that request's attempt only: neither rank's
    step raises, the retry delivers the colocated engine's tokens, and every page comes back.
    (A receiver its sender cannot reach hears nothing from it: it gives up at its deadline.)"""
    # a receiver that hears nothing (unreachable sender, lost notification) gives up at its deadline
    deadlines = {"kv_timeout_s": 1.0, "abort_grace_s": 0.5} if fault in ("unreachable", "drop") else {}
    prefill, decode = _workers(tiny, decode_pages=32, layerwise=True, fault=fault, **deadlines)
    rng = random.Random(fault)
    prompt = [rng.randrange(256) for _ in range(30)]
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    if fault == "corrupt-logprobs":
        sampling = dataclasses.replace(sampling, logprobs=2, prompt_logprobs=1)
    result = _run(prefill, decode, _requests([prompt], [sampling], fault))[f"{fault}0"]
    engine = ColocatedEngine(_model(tiny), EngineConfig(page_size=PAGE, num_pages=64))
    (reference,) = engine.generate([prompt], [sampling])
    assert list(result.token_ids) == reference.token_ids, (result.error, result.bill.attempts)
    agent = prefill.transport.agent  # type: ignore[attr-defined]
    assert isinstance(agent, _FaultyAgent) and agent.left == 0  # the fault happened
    failed, delivered = result.bill.attempts
    assert not failed.delivered and failed.error and delivered.delivered
    if fault == "corrupt":
        assert "malformed notification" in failed.error
    if fault == "corrupt-count":
        assert "cached_tokens" in failed.error
    if fault == "corrupt-logprobs":  # the retry's are the colocated engine's
        assert "logprobs.prompt" in failed.error
        assert len(result.logprobs) == 4 and len(result.prompt_logprobs) == len(prompt)
        assert result.prompt_logprobs[0] is None and reference.prompt_logprobs[0] is None
        pairs = [
            *zip(result.logprobs, reference.logprobs, strict=True),
            *zip(result.prompt_logprobs[1:], reference.prompt_logprobs[1:], strict=True),
        ]
        for got, expected in pairs:
            assert got is not None and expected is not None and got.token_id == expected.token_id
            assert abs(got.logprob - expected.logprob) < 1e-6
            assert [t for t, _ in got.top] == [t for t, _ in expected.top]
    decode.scheduler.check_integrity()
    prefill.scheduler.check_integrity()
    assert decode.scheduler.num_free_pages == 32 and prefill.scheduler.num_free_pages == 64
    assert prefill.transport.in_flight() == (0, 0) and decode.transport.in_flight() == (0, 0)
    prefill.transport.close()
    decode.transport.close()


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole-request"])
def test_no_write_is_posted_before_its_layers_ready_event_completes(tiny: Path, layerwise: bool) -> None:
    """The forward hands the transport one event per layer (as a GPU's CUDA events would be):
    with every event held open, the forward ends and nothing is written; opened out of order,
    only the layers whose events and all earlier ones completed are written; once all are open,
    the request completes with the colocated engine's tokens."""
    prefill, decode = _workers(tiny, decode_pages=32, layerwise=layerwise)
    transport = prefill.transport
    assert isinstance(transport, NixlTransport)
    counter = CountingAgent(transport.agent)
    transport.agent = counter
    gates: list[HeldEvent] = []

    def held_event() -> HeldEvent:
        gates.append(HeldEvent())
        return gates[-1]

    prefill.runner.kv_event = held_event  # type: ignore[method-assign]
    rng = random.Random(f"gate-{layerwise}")
    prompt = [rng.randrange(256) for _ in range(20)]
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    _submit(decode, _requests([prompt], [sampling], "gated"))
    for _ in range(200):  # the decode rank sends the job; the prefill rank runs its forward
        decode.tick()
        prefill.tick()
        if prefill.has_work():
            prefill.step()
        if gates:
            break
    layers = prefill.runner.model.cfg.num_hidden_layers
    assert len(gates) == (layers if layerwise else 1)
    for _ in range(20):
        prefill.tick()
        decode.tick()
    assert counter.posted == 0 and decode.scheduler.num_waiting_for_kv == 1
    if layerwise:
        gates[1].open()  # layer 1 is done, layer 0 not yet: nothing may go
        hold(0.2, lambda: counter.posted == 0, prefill.tick)
        gates[0].open()  # the transport's watcher posts both, in order
        wait_until(lambda: counter.posted == 2)
    for gate in gates:
        gate.open()
    done = _drive(prefill, decode, until=1)
    engine = ColocatedEngine(_model(tiny), EngineConfig(page_size=PAGE, num_pages=64))
    assert list(done["gated0"].token_ids) == engine.generate([prompt], [sampling])[0].token_ids
    assert counter.posted == (layers if layerwise else 1)
    decode.scheduler.check_integrity()
    assert decode.scheduler.num_free_pages == 32 and prefill.scheduler.num_free_pages == 64
    prefill.transport.close()
    decode.transport.close()


def test_layer_writes_leave_while_the_forward_runs_and_the_figures_end_at_the_device(tiny: Path) -> None:
    """A GPU's case on the CPU: the runner's ready events complete behind the host, as a device's
    do. A "device" thread opens each layer's event shortly after the hook for that layer ran, and
    each layer's attention waits (up to 10 s) until the layers before it have been written,
    nothing calling into the transport meanwhile: every layer but the last is posted by the
    transport's watcher before ``runner.run`` returns. The last layer's event opens 0.3 s after
    the forward returned: that time is in the compute figure, and the exposed figure starts
    after it."""
    prefill, decode = _workers(tiny, decode_pages=32, layerwise=True)
    transport = prefill.transport
    assert isinstance(transport, NixlTransport)
    counter = CountingAgent(transport.agent)
    transport.agent = counter
    model, layers, held_s = prefill.runner.model, prefill.runner.model.num_kv_layers, 0.3
    made: queue.Queue[HeldEvent] = queue.Queue()

    def device_event() -> HeldEvent:
        event = HeldEvent()
        made.put(event)
        return event

    written_in_time: list[bool] = []  # per layer: the layers before it were written while it waited

    def after_layers_written(count: int) -> Callable[..., None]:
        def pre_hook(module: Any, args: Any) -> None:
            deadline = time.monotonic() + 10.0
            while counter.posted < count and time.monotonic() < deadline:
                time.sleep(0.002)
            written_in_time.append(counter.posted >= count)

        return pre_hook

    for layer in model.layers:
        layer.self_attn.register_forward_pre_hook(after_layers_written(layer.index))
    run, returned = prefill.runner.run, threading.Event()
    called_s: list[float] = []
    returned_s: list[float] = []

    def timed_run(
        plan: Any, on_layer_kv: Callable[[int], None] | None = None, exports: Any = None
    ) -> dict[str, int]:
        called_s.append(time.monotonic())
        tokens = run(plan, on_layer_kv, exports)
        returned_s.append(time.monotonic())
        returned.set()
        return tokens

    events: list[HeldEvent] = []

    def device() -> None:
        for index in range(layers):
            events.append(made.get(timeout=30.0))
            if index == layers - 1:  # the last layer's kernels end well after the forward returned
                returned.wait(30.0)
                time.sleep(held_s)
            else:
                time.sleep(0.01)  # a little behind the host
            events[-1].open()

    prefill.runner.kv_event = device_event  # type: ignore[method-assign]
    prefill.runner.run = timed_run  # type: ignore[method-assign]
    device_thread = threading.Thread(target=device, name="device")
    device_thread.start()
    prompt = [random.Random("device").randrange(256) for _ in range(20)]  # one chunk, one forward
    sampling = SamplingParams(max_tokens=3, ignore_eos=True)
    done = _run(prefill, decode, _requests([prompt], [sampling], "device"))
    device_thread.join(30.0)
    (called_at,), (returned_at,) = called_s, returned_s
    assert len(events) == counter.posted == layers
    assert written_in_time == [True] * layers  # no call into the transport while each waited
    assert all(posted < returned_at for posted in counter.posted_s[:-1])  # during the forward
    assert counter.posted_s[-1] >= events[-1].opened_s >= returned_at + held_s
    assert set(counter.posted_by) == {f"kv-watcher-{transport.agent_name}"}
    (sent,) = prefill.sent
    assert sent.compute_done_s >= events[-1].opened_s  # the exposed part starts after the wait
    (attempt,) = done["device0"].bill.attempts
    assert attempt.prefill_compute_s >= sent.compute_done_s - called_at >= returned_at + held_s - called_at
    assert attempt.kv_sender_exposed_s == pytest.approx(sent.notified_s - sent.compute_done_s)
    engine = ColocatedEngine(_model(tiny), EngineConfig(page_size=PAGE, num_pages=64))
    assert list(done["device0"].token_ids) == engine.generate([prompt], [sampling])[0].token_ids
    assert decode.scheduler.num_free_pages == 32 and prefill.scheduler.num_free_pages == 64
    prefill.transport.close()
    decode.transport.close()


def test_the_gpu_transfer_check_passes_between_host_pools() -> None:
    """``scripts/gpu-check.sh``'s transfer check, run on the CPU: its page comparison and tokens
    hold here, so on a GPU a difference is the device's."""
    from tandem.bench.gpu_transfer_check import main

    assert main(["--device", "cpu"]) == 0


class _HeldDispatcher(_Direct):
    """Jobs wait here until the test delivers them: a job still on its way to the prefill rank."""

    def __init__(self, worker: PrefillWorker) -> None:
        super().__init__(worker)
        self.held: list[PrefillJob] = []

    def send(self, prefill_rank: RankId, job: PrefillJob) -> None:
        self.held.append(job)

    def deliver(self) -> None:
        for job in self.held:
            self.worker.submit([(job, time.monotonic())])
        self.held = []


def test_a_cancel_that_overtakes_its_job_is_kept_until_the_job_arrives_and_is_refused(tiny: Path) -> None:
    """The client cancels while the prefill job is still on its way: the prefill rank keeps the
    cancellation (not in a list of bounded length), refuses the job when it arrives, and only
    then tells the decode rank, whose pages are freed; no forward runs for it."""
    prefill, decode = _workers(tiny, decode_pages=16, layerwise=True)
    held = _HeldDispatcher(prefill)
    decode.dispatcher = held
    _submit(decode, _requests([[3] * 20], [SamplingParams(max_tokens=4)], "late"))
    decode.tick()
    assert len(held.held) == 1 and decode.scheduler.num_waiting_for_kv == 1
    decode.abort("late0")
    deadline = time.monotonic() + 10
    key = held.held[0].request_id
    while not prefill.transport.is_cancelled(key) and time.monotonic() < deadline:
        decode.tick()  # the ABORT reaches the prefill rank; no job there to drop yet
        prefill.tick()
    assert prefill.transport.is_cancelled(key)
    for _ in range(200):
        decode.tick()
        prefill.tick()
    assert decode.scheduler.num_waiting_for_kv == 1  # no ack yet: its pages stay reserved
    steps = prefill.runner.stats.steps
    held.deliver()
    done = _drive(prefill, decode, until=1)
    assert done["late0"].finish_reason == "abort"
    assert prefill.cancelled_jobs == 1 and prefill.runner.stats.steps == steps and prefill.pending() == 0
    assert not prefill.transport.is_cancelled(key)  # refused and acked: nothing left of it
    decode.scheduler.check_integrity()
    assert decode.scheduler.num_free_pages == 16 and prefill.scheduler.num_free_pages == 64
    assert prefill.transport.in_flight() == (0, 0) and decode.transport.in_flight() == (0, 0)
    prefill.transport.close()
    decode.transport.close()


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_a_request_resumed_from_its_streamed_tokens_gives_the_undisturbed_tokens(
    tiny: Path, seeded: bool
) -> None:
    """What a decode rank does with a request moved to it from a failed one: it gets the prompt
    and the first 5 outputs, recomputes their KV through a prefill rank, streams from index 5 on,
    and every token equals the colocated engine's undisturbed run (seeded draws keep their
    output index)."""
    prefill, decode = _workers(tiny, decode_pages=32, layerwise=True)
    rng = random.Random(f"resume-{seeded}")
    prompt = [rng.randrange(256) for _ in range(21)]
    sampling = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9 if seeded else 0.0, seed=7)
    engine = ColocatedEngine(_model(tiny), EngineConfig(page_size=PAGE, num_pages=64))
    want = engine.generate([prompt], [sampling])[0].token_ids
    request = Request("moved", prompt, sampling, frozenset({257}), 512)
    request.output_token_ids = list(want[:5])
    decode.submit([(request, Routing(frontend="fe"), time.monotonic())])
    deltas, results = [], []
    deadline = time.monotonic() + 60
    while not results and time.monotonic() < deadline:
        decode.tick()
        prefill.tick()
        if prefill.has_work():
            prefill.step()
        if decode.has_work():
            decode.step()
        batch = decode.take_pushes().get("fe")
        if batch is not None:
            deltas += batch.deltas
            results += batch.finished
    (result,) = results
    assert list(result.token_ids) == want and result.error is None, result
    streamed = [t for d in deltas for t in d.token_ids]
    assert deltas[0].start_index == 5 and streamed == want[5:]
    assert decode.scheduler.num_running == 0 and decode.scheduler.num_free_pages == 32
    prefill.transport.close()
    decode.transport.close()


def test_a_guided_request_disaggregated_or_moved_gives_the_colocated_tokens(tiny: Path) -> None:
    """A structured output across ranks: the prefill rank draws the first token under the
    schema, the decode rank the rest, each from its own matcher; a request moved to a decode
    rank in the middle of its JSON (its outputs so far given) rebuilds its matcher from them
    and goes on. Both give the colocated engine's tokens, which parse and validate."""
    schema = {
        "type": "object",
        "properties": {"word": {"type": "string", "maxLength": 6}, "n": {"type": "integer", "maximum": 99}},
        "required": ["word", "n"],
        "additionalProperties": False,
    }
    guide = Guide(GuideKind.JSON_SCHEMA, json.dumps(schema))
    sampling = SamplingParams(max_tokens=60, temperature=1.0, seed=11, guide=guide)
    rng = random.Random("guided")
    prompt = [rng.randrange(256) for _ in range(19)]
    engine = ColocatedEngine(
        _model(tiny), EngineConfig(page_size=PAGE, num_pages=64), Tokenizer.from_dir(tiny)
    )
    want = engine.generate([prompt], [sampling])[0]
    value = json.loads(want.text)
    assert set(value) == {"word", "n"} and len(value["word"]) <= 6 and want.finish_reason == "stop"
    prefill, decode = _workers(tiny, decode_pages=32, layerwise=True, guided=True)
    (whole,) = _run(prefill, decode, _requests([prompt], [sampling], "g")).values()
    assert list(whole.token_ids) == want.token_ids
    assert prefill.runner.guides is not None and decode.runner.guides is not None
    assert len(prefill.runner.guides) == len(decode.runner.guides) == 0  # dropped when done
    moved = Request("moved", prompt, sampling, frozenset({257}), 512)
    moved.output_token_ids = list(want.token_ids[:7])  # inside the first string
    rebuilt_before = decode.runner.guides.rebuilt
    (result,) = _run(prefill, decode, [moved]).values()
    assert list(result.token_ids) == want.token_ids and result.error is None
    assert decode.runner.guides.rebuilt == rebuilt_before + 1  # made from the 7 tokens at once
    assert decode.scheduler.num_free_pages == 32
    prefill.transport.close()
    decode.transport.close()


def test_a_resumed_request_is_checked_at_admission() -> None:
    from tandem.engine.admission import resumed_outputs
    from tandem.wire.messages import RankRequest

    def resumed(outputs: tuple[int, ...], max_tokens: int = 8, prompt: tuple[int, ...] = (1, 2)) -> list[int]:
        sampling = SamplingParams(max_tokens=max_tokens)
        return resumed_outputs(RankRequest("r", prompt, sampling, resume_output_ids=outputs), 100, 16)

    assert resumed((3, 4)) == [3, 4]
    for outputs, kwargs, message in [
        ((3, 100), {}, "token ids in"),
        ((1,) * 8, {}, "not below max_tokens"),
        ((1,) * 14, {"max_tokens": 100}, "fill the context"),
    ]:
        with pytest.raises(InvalidRequestError, match=message):
            resumed(outputs, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("trigger", ["client-cancel", "kv-deadline"])
def test_pages_of_an_aborted_transfer_stay_reserved_until_its_last_write_lands(
    tiny: Path, trigger: str
) -> None:
    """A layer-wise send is in flight, its writes still landing, when the decode rank gives up on
    it (the client cancels, or the KV deadline passes). The sender acknowledges only once every
    posted write is over, so until then the decode rank keeps the pages reserved: none returns to
    the free list and no other request is given them. Then the request ends (aborted, or retried
    and exact) and every page comes back."""
    deadline_s = 1.0 if trigger == "kv-deadline" else 30.0
    prefill, decode = _workers(
        tiny, decode_pages=8, layerwise=True, kv_timeout_s=deadline_s, abort_grace_s=60.0
    )
    transport = prefill.transport
    assert isinstance(transport, NixlTransport)
    held = HeldWrites(transport.agent)
    transport.agent = held
    rng = random.Random(f"held-{trigger}")
    prompt, other = ([rng.randrange(256) for _ in range(n)] for n in (30, 40))
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    _submit(decode, _requests([prompt], [sampling], "first"))
    deadline = time.monotonic() + 30
    while not held.held:  # the forward runs and posts its layers' writes, which stay in flight
        assert time.monotonic() < deadline
        _drive(prefill, decode, until=0, steps=1)
    reserved_free = decode.scheduler.num_free_pages  # 4 of the 8 pages are the first request's
    assert reserved_free == 4 and decode.scheduler.num_waiting_for_kv == 1
    _submit(decode, _requests([other], [sampling], "second"))  # needs 6 pages: must wait
    if trigger == "client-cancel":
        decode.abort("first0")
    # past the KV deadline (if that is the trigger), with time for the abort and an answer
    hold_until = time.monotonic() + (deadline_s if trigger == "kv-deadline" else 0.0) + 1.5
    while time.monotonic() < hold_until:
        decode.tick()
        prefill.tick()
        assert decode.scheduler.num_free_pages == reserved_free  # no page freed, none handed out
        assert decode.scheduler.num_queued == 1 and decode.scheduler.num_waiting_for_kv == 1
        assert not decode.take_results()
        time.sleep(0.01)
    assert transport.in_flight()[0] == 1  # the sender saw the abort and waits for its writes
    held.release()
    done = _drive(prefill, decode, until=2)
    engine = ColocatedEngine(_model(tiny), EngineConfig(page_size=PAGE, num_pages=64))
    want = engine.generate([prompt, other], [sampling, sampling])
    if trigger == "client-cancel":
        assert done["first0"].finish_reason == "abort"
    else:  # the failed attempt is billed, and the retry delivers the exact tokens
        assert list(done["first0"].token_ids) == want[0].token_ids
        failed = done["first0"].bill.attempts[0]
        assert not failed.delivered and "no completion from" in (failed.error or "")
    assert list(done["second0"].token_ids) == want[1].token_ids
    decode.scheduler.check_integrity()
    prefill.scheduler.check_integrity()
    assert decode.scheduler.num_free_pages == 8 and prefill.scheduler.num_free_pages == 64
    assert prefill.transport.in_flight() == (0, 0) and decode.transport.in_flight() == (0, 0)
    prefill.transport.close()
    decode.transport.close()


@pytest.mark.parametrize(
    ("prompt_len", "abort_parent"), [(21, False), (24, True)], ids=["mid-page", "page-end-parent-aborted"]
)
def test_a_forked_choice_shares_the_prompt_pages_and_gives_the_request_sent_alone(
    tiny: Path, prompt_len: int, abort_parent: bool
) -> None:
    """Choices 1 and 2 of a request for three reach the decode rank while choice 0 runs there:
    they take its prompt pages (no prefill job, no transfer), each with its own copy of the page
    holding the prompt's last position, and give the tokens each gives sent alone with its
    seed. The parent aborted before the children's first step leaves them its shared pages
    (written before the children draw anything); every page is free at the end."""
    prefill, decode = _workers(tiny, decode_pages=32, layerwise=True)
    jobs: list[str] = []
    send = decode.dispatcher.send
    decode.dispatcher.send = lambda rank, job: (jobs.append(job.request_id), send(rank, job))[1]  # type: ignore[method-assign]
    rng = random.Random(f"fork-{prompt_len}")
    prompt = [rng.randrange(256) for _ in range(prompt_len)]
    sampling = [SamplingParams(max_tokens=10, ignore_eos=True, temperature=1.0, seed=s) for s in (41, 42, 43)]
    engine = ColocatedEngine(_model(tiny), EngineConfig(page_size=PAGE, num_pages=64))
    want = [o.token_ids for o in engine.generate([prompt] * 3, sampling)]
    _submit(decode, [Request("c0", prompt, sampling[0], frozenset({257}), 512)])
    deadline = time.monotonic() + 60
    while decode.scheduler.num_running == 0 and time.monotonic() < deadline:
        decode.tick()
        prefill.tick()
        if prefill.has_work():
            prefill.step()
    parent = decode.scheduler.get("c0")
    assert parent is not None and decode.scheduler.num_running == 1
    children = [Request(f"c{i}", prompt, sampling[i], frozenset({257}), 512) for i in (1, 2)]
    decode.submit([(c, Routing(fork_of="c0"), time.monotonic()) for c in children])
    assert decode.forks == 2 and jobs == ["c0#0"]  # its attempt 0
    last = (prompt_len - 1) // PAGE
    for child in children:
        assert child.page_ids[:last] == parent.page_ids[:last]  # shared
        assert child.page_ids[last] not in parent.page_ids  # its own copy
    kv = decode.runner.pool.kv
    assert torch.equal(kv[:, children[0].page_ids[last]], kv[:, parent.page_ids[last]])
    assert decode.scheduler.kv_cache.refcount(parent.page_ids[0]) == 3
    decode.scheduler.check_integrity()
    if abort_parent:
        decode.abort("c0")
        assert decode.scheduler.kv_cache.refcount(children[0].page_ids[0]) == 2
        decode.scheduler.check_integrity()
    done = _drive(prefill, decode, until=3)
    for i in (1, 2):
        result = done[f"c{i}"]
        assert list(result.token_ids) == want[i], i
        bill = result.bill
        assert bill.cached_tokens == prompt_len - 1 and bill.new_prompt_tokens == 1
        assert bill.cached_tokens_by_tier.device == prompt_len - 1 and bill.kv_bytes == 0
    if not abort_parent:
        assert list(done["c0"].token_ids) == want[0]
    assert jobs == ["c0#0"] and decode.scheduler.num_free_pages == 32
    decode.scheduler.check_integrity()
    prefill.transport.close()
    decode.transport.close()


def test_a_fork_whose_parent_is_gone_is_prefilled_as_any_request(tiny: Path) -> None:
    """The parent finished (or never came here): the choice is prefilled and transferred as a
    request of its own, with the same tokens."""
    prefill, decode = _workers(tiny, decode_pages=32, layerwise=True)
    prompt = [random.Random("gone").randrange(256) for _ in range(13)]
    sampling = SamplingParams(max_tokens=6, ignore_eos=True, temperature=1.0, seed=5)
    engine = ColocatedEngine(_model(tiny), EngineConfig(page_size=PAGE, num_pages=64))
    (want,) = engine.generate([prompt], [sampling])
    child = Request("c1", prompt, sampling, frozenset({257}), 512)
    decode.submit([(child, Routing(fork_of="c0"), time.monotonic())])
    assert decode.forks == 0
    done = _drive(prefill, decode, until=1)
    assert list(done["c1"].token_ids) == want.token_ids and done["c1"].bill.kv_bytes > 0
    assert decode.scheduler.num_free_pages == 32
    prefill.transport.close()
    decode.transport.close()
