"""The frontend's grammar checker in its own process (``frontend/grammar_checker.py``), on the
demo model: a spec that compiles passes, one that does not is an error naming its field, both
from the child; torch is loaded there, not here; a child that dies fails the checks waiting on it,
naming their fields, and the next check starts another."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.cluster.serve import demo_model_dir
from tandem.frontend.grammar_checker import GrammarProcess
from tandem.model.config import ModelConfig
from tandem.model.grammar_compiler import GrammarTimeLimit
from tandem.wire.request_params import Guide, GuideKind, InvalidRequestError
from tests.model.grammar_doubles import SLOW_GUIDE


@pytest.fixture(scope="module")
def checker() -> Iterator[GrammarProcess]:
    model_dir = str(demo_model_dir())
    process = GrammarProcess(model_dir, ModelConfig.from_dir(model_dir).vocab_size, 30.0)
    process.start()
    yield process
    process.close()


def test_a_spec_is_checked_in_the_child_and_a_bad_one_names_its_field(checker: GrammarProcess) -> None:
    asyncio.run(checker.check(Guide(GuideKind.REGEX, "[a-z]{2,5}"), "response_format"))
    with pytest.raises(InvalidRequestError) as raised:
        asyncio.run(checker.check(Guide(GuideKind.JSON_SCHEMA, '{"type": "no"}'), "tools.0.function"))
    assert raised.value.field == "tools.0.function"
    assert checker.compiled == 2


def test_torch_is_loaded_in_the_child_and_not_here(checker: GrammarProcess) -> None:
    assert checker._child is not None
    maps = Path(f"/proc/{checker._child.pid}/maps").read_text()
    assert "libtorch" in maps  # xgrammar's import of it: the reason the child exists
    code = "import tandem.frontend.grammar_checker, sys; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr


def test_a_child_that_dies_fails_its_waiting_checks_and_is_started_again(checker: GrammarProcess) -> None:
    async def one_killed_then_another() -> None:
        slow = asyncio.ensure_future(checker.check(SLOW_GUIDE, "response_format"))
        while not checker._waiting:  # sent: now the child holds it
            await asyncio.sleep(0.01)
        assert checker._child is not None
        first = checker._child.pid
        checker._child.kill()
        with pytest.raises(GrammarTimeLimit) as raised:
            await slow
        assert raised.value.field == "response_format" and "checker stopped" in raised.value.message
        await checker.check(Guide(GuideKind.REGEX, "[0-9]{1,3}"), "response_format")
        assert checker._child is not None and checker._child.pid != first

    asyncio.run(one_killed_then_another())
