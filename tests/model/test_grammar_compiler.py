"""The grammar compiler's pool, limit and cache on the demo model's vocabulary: several specs
compile at once, a compile past its time limit fails its askers and is not compiled again (nor
holds the only worker), ``poll`` never waits, and a spec asked twice is compiled once."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from tandem.model.grammar import GrammarCompiler, GrammarTimeLimit
from tandem.model.tokenizer import Tokenizer
from tandem.wire.request_params import Guide, GuideKind, InvalidRequestError
from tests.model.grammar_doubles import SLOW_GUIDE, HeldCompiler

DEMO = Path(__file__).resolve().parents[2] / "model" / "demo"
VOCAB = 258
WORDS, DIGITS = Guide(GuideKind.REGEX, "[a-z]{2,5}"), Guide(GuideKind.REGEX, "[0-9]{1,3}")


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_dir(DEMO)


def test_two_different_specs_compile_at_the_same_time(tokenizer: Tokenizer) -> None:
    """Each compile waits until two run at once: with one compiler thread neither finishes."""
    compiler = HeldCompiler(tokenizer, VOCAB, held=(), meet=2)
    outcomes: dict[str, object] = {}

    def ask(name: str, guide: Guide) -> None:
        try:
            outcomes[name] = compiler.compile(guide, name)
        except InvalidRequestError as exc:
            outcomes[name] = exc

    threads = [threading.Thread(target=ask, args=(n, g)) for n, g in (("a", WORDS), ("b", DIGITS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert compiler.most_at_once == 2
    assert not any(isinstance(o, InvalidRequestError) for o in outcomes.values()), outcomes


def test_a_compile_past_its_limit_fails_and_is_not_compiled_again(tokenizer: Tokenizer) -> None:
    compiler = HeldCompiler(tokenizer, VOCAB, time_limit_s=0.2, max_hold_s=60.0)
    compiler.setup()
    with pytest.raises(GrammarTimeLimit) as info:
        compiler.compile(WORDS, "response_format.json_schema.schema")
    assert compiler.running == 1  # refused at the limit, while the compile is held back
    assert info.value.field == "response_format.json_schema.schema"
    assert "within the limit of 0.2 s" in info.value.message
    with pytest.raises(GrammarTimeLimit):  # asked again while it still runs: at once
        compiler.compile(WORDS, "tools")
    assert compiler.running == 1
    compiler.release.set()
    compiler.prepare(WORDS).result(timeout=30)  # xgrammar returned: still past the limit
    with pytest.raises(GrammarTimeLimit):
        compiler.poll(WORDS, time.monotonic())
    assert compiler.compiled == 1


def test_a_compile_past_its_limit_leaves_workers_for_the_next_spec(tokenizer: Tokenizer) -> None:
    compiler = HeldCompiler(tokenizer, VOCAB, held={WORDS}, time_limit_s=0.3, max_hold_s=30.0)
    compiler.setup()
    with pytest.raises(GrammarTimeLimit):
        compiler.compile(WORDS)  # its worker stays busy: xgrammar's compile cannot be stopped
    compiler.compile(DIGITS)  # another worker takes it
    compiler.release.set()


def test_poll_never_waits_and_gives_the_grammar_once_compiled(tokenizer: Tokenizer) -> None:
    compiler = HeldCompiler(tokenizer, VOCAB, max_hold_s=30.0)
    asked = time.monotonic()
    assert compiler.poll(WORDS, asked) is None  # had it waited, the held compile would have ended
    compiler.release.set()
    compiler.prepare(WORDS).result(timeout=10)
    assert compiler.poll(WORDS, asked) is not None


def test_a_spec_that_waits_past_the_limit_for_a_worker_is_refused_as_busy(tokenizer: Tokenizer) -> None:
    compiler = HeldCompiler(tokenizer, VOCAB, workers=1, time_limit_s=0.3, max_hold_s=30.0)
    compiler.setup()
    compiler.prepare(WORDS)  # holds the one worker
    with pytest.raises(GrammarTimeLimit, match="busy"):
        compiler.compile(DIGITS, "tools")
    compiler.release.set()


def test_the_same_spec_asked_twice_is_compiled_once(tokenizer: Tokenizer) -> None:
    compiler = GrammarCompiler(tokenizer, VOCAB)
    first = compiler.compile(Guide(GuideKind.REGEX, "(yes|no)"))
    assert compiler.compile(Guide(GuideKind.REGEX, "(yes|no)")) is first
    assert compiler.compiled == 1


def test_a_large_schema_compiles_beside_a_python_thread_that_keeps_running(tokenizer: Tokenizer) -> None:
    """xgrammar gives up the GIL while it compiles: a step loop beside a compile keeps its
    pace (a thread that sleeps 1 ms a turn keeps turning: with the GIL held it would not)."""
    compiler = GrammarCompiler(tokenizer, VOCAB)
    compiler.compile(Guide(GuideKind.REGEX, "a"))  # xgrammar and the vocabulary, set up
    future = compiler.prepare(SLOW_GUIDE)
    gaps, last = [], time.perf_counter()
    while not future.done():
        time.sleep(0.001)
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
    future.result()
    assert len(gaps) > 50
