"""The frontend's check of a structured output: a spec that does not compile within
``grammar_compile_limit_s`` is a 400 naming its field (``response_format`` or ``tools``) through
the OpenAI app, answered at the limit, and at once when asked again; several specs compile at
the same time (both with the compiler held in this process); a spec checked twice is compiled
once (the real checker's process). A real core over the demo model, no cluster: the check comes
before any rank is asked."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from tandem.cluster.serve import demo_model_dir
from tandem.frontend import grammar_checker
from tandem.frontend.core import FrontendConfig, FrontendCore
from tandem.frontend.grammar_checker import GrammarProcess
from tandem.frontend.limits import EdgeLimits
from tandem.model.tokenizer import Tokenizer
from tandem.wire.request_params import Guide, GuideKind
from tests.model.grammar_doubles import SLOW_SCHEMA, HeldCompiler

LIMIT_S = 0.2


def _core(limit_s: float | None = LIMIT_S) -> FrontendCore:
    """The demo model's core; ``None``: the default limit."""
    limits = EdgeLimits() if limit_s is None else EdgeLimits(grammar_compile_limit_s=limit_s)
    return FrontendCore(FrontendConfig(str(demo_model_dir()), "demo", limits=limits))


def _hold(monkeypatch: pytest.MonkeyPatch, **held: Any) -> None:
    """The frontend's checker: a compiler in this process whose compiles can be held back."""

    def start(model_dir: str, vocab_size: int, limit_s: float) -> HeldCompiler:
        return HeldCompiler(Tokenizer.from_dir(model_dir), vocab_size, limit_s, **held)

    monkeypatch.setattr(grammar_checker, "start_checker", start)


def _post(core: FrontendCore, body: dict[str, Any]) -> tuple[int, dict[str, Any], float]:
    """The app's status, JSON body and the seconds it took to answer."""
    import httpx2 as httpx

    from tandem.frontend.openai_http import build_app

    async def call() -> tuple[int, dict[str, Any], float]:
        transport = httpx.ASGITransport(app=build_app(core))
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
            start = time.monotonic()
            reply = await client.post("/v1/chat/completions", json={"model": "demo", **body})
            return reply.status_code, reply.json(), time.monotonic() - start

    return asyncio.run(call())


RESPONSE_FORMAT = {
    "response_format": {"type": "json_schema", "json_schema": {"name": "big", "schema": SLOW_SCHEMA}}
}
TOOLS = {
    "tools": [{"type": "function", "function": {"name": "fill", "parameters": SLOW_SCHEMA}}],
    "tool_choice": "required",
}


@pytest.mark.parametrize(("fields", "named"), [(RESPONSE_FORMAT, "response_format"), (TOOLS, "tools")])
def test_a_schema_past_the_compile_limit_is_a_400_naming_its_field(
    fields: dict[str, Any], named: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The compile is held back (it would take about a second on the demo's vocabulary) past
    the limit of 0.2 s: the 400 comes while it still runs, not once it ends."""
    _hold(monkeypatch, held=None, max_hold_s=60)
    core = _core()
    body = {"messages": [{"role": "user", "content": "Fill it in."}], "max_tokens": 8, **fields}
    status, reply, _ = _post(core, body)
    compiler = core._grammar
    assert isinstance(compiler, HeldCompiler) and compiler.running == 1  # answered during the compile
    assert status == 400, reply
    error = reply["error"]
    assert error["param"].startswith(named) and "within the limit of 0.2 s" in error["message"]
    compiler.release.set()
    deadline = time.monotonic() + 60
    while compiler.running and time.monotonic() < deadline:
        time.sleep(0.05)
    status, reply, _ = _post(core, body)  # asked again: refused at once, not compiled again
    assert status == 400 and "within the limit" in reply["error"]["message"]
    assert compiler.compiled == 1 and compiler.running == 0


def test_two_specs_are_checked_at_the_same_time(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each compile waits until two run at once: behind one compiler thread neither ends."""
    _hold(monkeypatch, held=(), meet=2)
    core = _core(limit_s=None)

    async def both() -> None:
        await asyncio.gather(
            core.check_guide(Guide(GuideKind.REGEX, "[a-z]{2,5}"), "response_format"),
            core.check_guide(Guide(GuideKind.REGEX, "[0-9]{1,3}"), "tools"),
        )

    asyncio.run(both())
    assert isinstance(core._grammar, HeldCompiler) and core._grammar.most_at_once == 2


def test_a_spec_checked_twice_is_compiled_once() -> None:
    core = _core(limit_s=None)
    guide = Guide(GuideKind.JSON_SCHEMA, '{"type": "object", "properties": {"n": {"type": "integer"}}}')

    async def twice() -> None:
        await core.check_guide(guide, "response_format")
        await core.check_guide(guide, "response_format")

    try:
        asyncio.run(twice())
        assert isinstance(core._grammar, GrammarProcess) and core._grammar.compiled == 1
    finally:
        if isinstance(core._grammar, GrammarProcess):
            core._grammar.close()
