"""Structured outputs' grammars, compiled with xgrammar (no torch: the frontend checks a spec
with it): a request's ``Guide`` (a JSON schema, any JSON object, a regex, an EBNF grammar or a
structural tag) compiled against the model's vocabulary.

:class:`GrammarCompiler` compiles a guide once per process (an LRU cache keyed by the guide) on a
small pool of threads, each compile with a time limit: ``prepare`` starts it when a request
arrives, ``poll`` says whether it is ready without waiting (a rank holds a guided request out of
its batch until it is), ``compile``/``check`` wait for it (the edge's check that a spec compiles:
an error names what is wrong with it, or that it took too long). The token masks a rank draws
with are ``model/grammar.py``'s.

A length-bounded JSON string is compiled as a pattern (``_strings_without_control_characters``).
A JSON schema or object is generated compact: no whitespace between its tokens (a model that
likes spaces could otherwise fill its budget with them).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import json
import logging
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.model.tokenizer import Tokenizer
from tandem.wire.request_params import Guide, GuideKind, InvalidRequestError

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)

COMPILED_GRAMMARS = 256  # per process, least recently used dropped (never one still compiling)
# compiles at once per process. xgrammar releases the GIL while it compiles, so a step loop or
# an event loop beside them keeps running; a compile cannot be stopped, so one past its limit
# holds its worker until it ends: several workers, and a spec past its limit is not compiled again
COMPILE_WORKERS = 4
COMPILE_QUEUE = 64  # specs waiting for a worker; beyond, a new one is refused at once as busy
# a rank's limit: the frontend passed the spec within its own (``EdgeLimits``, shorter: a
# client waits for it); past this a request whose grammar is not ready ends with an error
# rather than hold its pages
COMPILE_TIME_LIMIT_S = 30.0
_NOISE = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")  # xgrammar's "[12:00:00] /file.cc:12: " prefix


class GrammarTimeLimit(InvalidRequestError):
    """A guide that did not compile within the time limit, or waited that long for a worker."""


def _xgr() -> Any:
    """xgrammar, imported at a process's first guide: it loads transformers (about 1 s and
    45 MB a process), which a rank or frontend that serves none never pays."""
    import xgrammar

    return xgrammar


def encoded_vocab(tokenizer: Tokenizer, vocab_size: int) -> list[bytes]:
    """Each token id's bytes, the model's padding ids and the special tokens as empty (never
    allowed: xgrammar's convention)."""
    special = tokenizer.special_token_ids()
    have = tokenizer.vocab_size
    return [tokenizer.token_bytes(i) if i < have and i not in special else b"" for i in range(vocab_size)]


@dataclass(eq=False)
class _Compile:
    """One guide's compilation: its future, and when a worker began and ended it (monotonic s)."""

    guide: Guide
    future: concurrent.futures.Future[xgr.CompiledGrammar]
    started_s: float | None = None
    ended_s: float | None = None


class GrammarCompiler:
    """Guides compiled for one vocabulary on a pool of ``workers`` threads, each guide once: the
    outcome (a grammar, a spec's error, or past ``time_limit_s``) is cached by the guide, least
    recently used dropped, and shared by every request of the process.

    Nothing here waits but ``compile`` and ``check``: ``prepare`` starts a compile and ``poll``
    says where it is, so a step loop holds a request out of its batch until its grammar is ready
    (``ModelRunner.guide_ready``). Verdicts:

    - ready: it compiled within ``time_limit_s`` of a worker taking it;
    - failed, for every asker: the spec does not compile, or it ran past ``time_limit_s``
      (remembered: not compiled again while cached; its worker stays busy until xgrammar returns,
      which is why there are several);
    - failed, for one asker: it waited ``time_limit_s`` and no worker took the spec yet (busy),
      or ``COMPILE_QUEUE`` specs wait already.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        vocab_size: int,
        time_limit_s: float = COMPILE_TIME_LIMIT_S,
        workers: int = COMPILE_WORKERS,
    ) -> None:
        """The vocabulary and xgrammar's compiler are made on a worker at the first guide."""
        if not time_limit_s > 0 or workers < 1:
            raise ValueError(f"time_limit_s must be > 0 and workers >= 1, got {time_limit_s}, {workers}")
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.time_limit_s = time_limit_s
        self.workers = workers
        self._compiler: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._init_lock = threading.Lock()
        self._cache: collections.OrderedDict[Guide, _Compile] = collections.OrderedDict()
        self.compiled = 0  # compilations begun (cache misses)
        self.wait_s = 0.0  # time callers of ``compile`` waited

    def prepare(self, guide: Guide) -> concurrent.futures.Future[xgr.CompiledGrammar]:
        """``guide`` compiled, or queued or compiling on a worker (``GrammarTimeLimit`` when the
        queue is full)."""
        return self._entry(guide).future

    def poll(self, guide: Guide, asked_s: float, field: str = "guide") -> xgr.CompiledGrammar | None:
        """``guide`` compiled, or ``None`` while it compiles within its limit; never waits.
        ``asked_s``: when the asker first wanted it (``time.monotonic``), which bounds its wait
        for a worker. A spec that does not compile raises ``InvalidRequestError``, one past the
        limit ``GrammarTimeLimit``, each naming ``field``."""
        return self._verdict(self._entry(guide), asked_s, field)

    def compile(self, guide: Guide, field: str = "guide") -> xgr.CompiledGrammar:
        """``guide`` compiled, waiting at most about ``time_limit_s`` (errors as ``poll``)."""
        asked_s = time.monotonic()
        entry = self._entry(guide)
        while (grammar := self._verdict(entry, asked_s, field)) is None:
            start = time.perf_counter()
            concurrent.futures.wait([entry.future], timeout=self._left_s(entry, asked_s))
            self.wait_s += time.perf_counter() - start
        return grammar

    async def check(self, guide: Guide, field: str) -> None:
        """``compile`` for an event loop: it waits without a thread (errors as ``poll``)."""
        asked_s = time.monotonic()
        entry = self._entry(guide)
        done = asyncio.Event()
        loop = asyncio.get_running_loop()

        def wake(_: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                loop.call_soon_threadsafe(done.set)

        entry.future.add_done_callback(wake)
        while self._verdict(entry, asked_s, field) is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), self._left_s(entry, asked_s))

    def _entry(self, guide: Guide) -> _Compile:
        with self._lock:
            entry = self._cache.get(guide)
            if entry is not None:
                self._cache.move_to_end(guide)
                return entry
            queued = sum(1 for e in self._cache.values() if e.started_s is None and not e.future.done())
            if queued >= COMPILE_QUEUE:
                raise GrammarTimeLimit("guide", self._busy(queued))
            entry = _Compile(guide, concurrent.futures.Future())
            entry.future = self._pool.submit(self._compile, entry)
            self._cache[guide] = entry
            for old in [e for e in self._cache.values() if e.future.done()]:
                if len(self._cache) <= COMPILED_GRAMMARS:
                    break
                del self._cache[old.guide]  # never one compiling: it would be compiled twice
            return entry

    def _verdict(self, entry: _Compile, asked_s: float, field: str) -> xgr.CompiledGrammar | None:
        now, limit = time.monotonic(), self.time_limit_s
        future = entry.future
        if future.done():
            error = future.exception()
            if error is None:
                assert entry.started_s is not None and entry.ended_s is not None
                if entry.ended_s - entry.started_s <= limit:
                    return future.result()
                raise GrammarTimeLimit(field, self._too_long(entry.guide))
            if isinstance(error, InvalidRequestError):
                raise type(error)(field, error.message) from None
            with self._lock:  # the server's failure, not the spec's: the next asker tries again
                if self._cache.get(entry.guide) is entry:
                    del self._cache[entry.guide]
            raise error
        if entry.started_s is not None and now - entry.started_s > limit:
            raise GrammarTimeLimit(field, self._too_long(entry.guide))
        # the process's first compile sets up xgrammar first: neither the spec's time nor a wait
        if entry.started_s is None and self._compiler is not None and now - asked_s > limit:
            raise GrammarTimeLimit(field, self._busy(self.workers))
        return None

    def _left_s(self, entry: _Compile, asked_s: float) -> float:
        """How long until ``entry``'s verdict may change without its future completing."""
        start = entry.started_s if entry.started_s is not None else asked_s
        return max(0.001, start + self.time_limit_s - time.monotonic() + 0.001)

    def _too_long(self, guide: Guide) -> str:
        return (
            f"the {guide.kind.value} did not compile within the limit of {self.time_limit_s:g} s; "
            "a smaller spec (fewer properties, shorter bounded strings) compiles faster"
        )

    def _busy(self, waiting: int) -> str:
        return (
            f"the grammar compilers are busy ({self.workers} workers, {waiting} specs ahead); "
            f"no worker took this spec within {self.time_limit_s:g} s: retry later"
        )

    def _compile(self, entry: _Compile) -> xgr.CompiledGrammar:
        compiler = self._xgr_compiler()  # its failure is the server's, not the spec's
        with self._lock:
            self.compiled += 1
        entry.started_s = time.monotonic()  # the vocabulary's set-up is not the spec's time
        try:
            return self._build(compiler, entry.guide)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors of a bad spec
            message = _NOISE.sub("", str(exc).strip()).splitlines()[0] if str(exc).strip() else repr(exc)
            raise InvalidRequestError(
                "guide", f"{entry.guide.kind.value} does not compile: {message}"
            ) from None
        finally:
            entry.ended_s = time.monotonic()

    def setup(self) -> None:
        """Import xgrammar and index the vocabulary now (seconds on a large vocabulary), as the
        first compile would; a caller on an event loop runs it on a thread first."""
        self._xgr_compiler()

    def _xgr_compiler(self) -> Any:
        """xgrammar's compiler over the vocabulary (on a worker, once; it is thread-safe)."""
        with self._init_lock:  # not ``_lock``: a step's ``poll`` must not wait for the vocabulary
            if self._compiler is None:
                xgr, tokenizer = _xgr(), self.tokenizer
                stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
                vocab = encoded_vocab(tokenizer, self.vocab_size)
                info = xgr.TokenizerInfo(
                    vocab, xgr.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=stops
                )
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _build(self, compiler: Any, guide: Guide) -> xgr.CompiledGrammar:
        """xgrammar's compilation of ``guide`` (on a worker; a test holds it back here)."""
        if guide.kind is GuideKind.JSON_OBJECT:
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if guide.kind is GuideKind.JSON_SCHEMA:
            schema = _json("schema", guide.spec)
            if not isinstance(schema, dict | bool):
                raise ValueError("a JSON schema is an object (or true/false)")
            schema = _strings_without_control_characters(schema)
            return compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        if guide.kind is GuideKind.REGEX:
            return compiler.compile_regex(guide.spec)
        if guide.kind is GuideKind.GRAMMAR:
            return compiler.compile_grammar(guide.spec)
        tag = _strings_without_control_characters(_json("structural tag", guide.spec))
        return compiler.compile_structural_tag(json.dumps(tag))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _strings_without_control_characters(schema: Any) -> Any:
    """``schema`` with each length-bounded string (``minLength``/``maxLength`` without a
    ``pattern`` or ``format``) given the pattern of its length over characters other than
    control characters. xgrammar 0.2.9 compiles such a string to any characters but quotes,
    backslashes and line ends, raw control characters included, which is not JSON; with the
    pattern it stays JSON (its characters are then never escapes)."""
    if isinstance(schema, list):
        return [_strings_without_control_characters(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    fixed = {k: _strings_without_control_characters(v) for k, v in schema.items()}
    bounded = "minLength" in fixed or "maxLength" in fixed
    if fixed.get("type") == "string" and bounded and "pattern" not in fixed and "format" not in fixed:
        low, high = fixed.get("minLength", 0), fixed.get("maxLength", "")
        if isinstance(low, int) and isinstance(high, int | str):
            fixed["pattern"] = f"^[^\\u0000-\\u001f]{{{low},{high}}}$"
            fixed.pop("minLength", None)  # the pattern holds them
            fixed.pop("maxLength", None)
    return fixed


def _json(what: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"the {what} is not JSON: {exc}") from None
