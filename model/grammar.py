"""Structured outputs with xgrammar: a request's ``Guide`` (a JSON schema, any JSON object, a
regex, an EBNF grammar or a structural tag) compiled against the model's vocabulary, and the
mask of the tokens it allows next.

- :class:`GrammarCompiler` compiles a guide once per rank (an LRU cache keyed by the guide) on
  its own thread: ``prepare`` starts it when a request arrives, so the step finds it compiled;
  ``compile`` is the same synchronously (the edge's check that a spec compiles: an error names
  what is wrong with it).
- :class:`GuidedRows` holds a matcher per guided request and gives a step's masks. A matcher's
  state follows from its guide and the request's outputs so far, which every sampling chunk of
  such a request carries (``ScheduledChunk.history``): before a row is masked its matcher takes
  the outputs it has not seen yet. The rank that samples the first token (a prefill rank), the
  decode rank that takes the request on and one it migrates to all rebuild the same state from
  the tokens, with nothing shipped between them; a matcher dropped from the bounded table is
  rebuilt the same way.

A length-bounded JSON string is compiled as a pattern (``_strings_without_control_characters``).
A JSON schema or object is generated compact: no whitespace between its tokens (a model that
likes spaces could otherwise fill its budget with them). Special tokens are never allowed, EOS
only once the grammar is complete.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import logging
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from tandem.model.tokenizer import Tokenizer
from tandem.wire.request_params import Guide, GuideKind, InvalidRequestError

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)

COMPILED_GRAMMARS = 256  # per rank, least recently used dropped
MATCHERS = 4096  # per rank: a dropped one is rebuilt from the request's tokens
_NOISE = re.compile(r"^\[[\d:]+\] \S+?:\d+: ")  # xgrammar's "[12:00:00] /file.cc:12: " prefix


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


class GrammarCompiler:
    """Guides compiled for one vocabulary, cached, one at a time on the compiler's thread."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        """The vocabulary and xgrammar's compiler are made on the compiler's thread at the
        first guide."""
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self._compiler: Any = None
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._lock = threading.Lock()
        self._cache: collections.OrderedDict[Guide, concurrent.futures.Future[xgr.CompiledGrammar]]
        self._cache = collections.OrderedDict()
        self.compiled = 0  # compilations run (cache misses)
        self.wait_s = 0.0  # time a step waited for a compilation it needed

    def prepare(self, guide: Guide) -> concurrent.futures.Future[xgr.CompiledGrammar]:
        """``guide`` compiled, or being compiled on the compiler's thread."""
        with self._lock:
            future = self._cache.get(guide)
            if future is not None:
                self._cache.move_to_end(guide)
                return future
            future = self._pool.submit(self._compile, guide)
            self._cache[guide] = future
            while len(self._cache) > COMPILED_GRAMMARS:
                self._cache.popitem(last=False)
            return future

    def compile(self, guide: Guide, field: str = "guide") -> xgr.CompiledGrammar:
        """``guide`` compiled (waiting for it); a spec that does not compile raises
        ``InvalidRequestError`` naming ``field`` (and is not kept)."""
        future = self.prepare(guide)
        if not future.done():
            start = time.perf_counter()
            concurrent.futures.wait([future])
            self.wait_s += time.perf_counter() - start
        error = future.exception()
        if error is not None:
            with self._lock:
                if self._cache.get(guide) is future:
                    del self._cache[guide]
            if isinstance(error, InvalidRequestError):
                raise InvalidRequestError(field, error.message) from None
            raise error
        return future.result()

    def _compile(self, guide: Guide) -> xgr.CompiledGrammar:
        self.compiled += 1
        compiler = self._xgr_compiler()  # its failure is the server's, not the spec's
        try:
            return self._build(compiler, guide)
        except (RuntimeError, ValueError, TypeError) as exc:  # xgrammar's errors of a bad spec
            message = _NOISE.sub("", str(exc).strip()).splitlines()[0] if str(exc).strip() else repr(exc)
            raise InvalidRequestError("guide", f"{guide.kind.value} does not compile: {message}") from None

    def _xgr_compiler(self) -> Any:
        """xgrammar's compiler over the vocabulary (on the compiler's thread, once)."""
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


@dataclass
class _Matcher:
    guide: Guide
    matcher: xgr.GrammarMatcher | None  # None: its guide did not compile (broken)
    fed: int = 0  # the outputs it has taken
    last: int | None = None  # the last of them
    broken: bool = False  # an output it could not take: only EOS is allowed from here


class GuidedRows:
    """Matchers of one rank's guided requests, and each step's token masks."""

    def __init__(self, compiler: GrammarCompiler, eos_token_id: int | None) -> None:
        self.compiler = compiler
        self.eos_token_id = eos_token_id
        self._matchers: collections.OrderedDict[str, _Matcher] = collections.OrderedDict()
        self.rebuilt = 0  # matchers made from a request's tokens so far (not its first)

    def allowed(self, rows: Sequence[tuple[str, Guide, Sequence[int]]]) -> torch.Tensor:
        """``[len(rows), vocab]`` bool, True where row ``(request id, guide, outputs so far)``
        may sample the token."""
        vocab, xgr = self.compiler.vocab_size, _xgr()
        bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
        for i, (request_id, guide, outputs) in enumerate(rows):
            try:
                state = self._state(request_id, guide, outputs)
            except InvalidRequestError as exc:  # the edges compile first: a request sent around them
                log.error("request %s: its guide does not compile (%s); it ends here", request_id, exc)
                state = _Matcher(guide, None, broken=True)
                self._matchers[request_id] = state
            if state.broken:
                bitmask[i].zero_()
                if self.eos_token_id is not None:
                    bitmask[i, self.eos_token_id // 32] = 1 << (self.eos_token_id % 32)
            else:
                assert state.matcher is not None
                state.matcher.fill_next_token_bitmask(bitmask, i)
        bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.bool().reshape(len(rows), -1)[:, :vocab]

    def _state(self, request_id: str, guide: Guide, outputs: Sequence[int]) -> _Matcher:
        state = self._matchers.get(request_id)
        # the outputs only grow; a matcher that saw others (a request id used again) starts over
        if state is not None and state.matcher is None and state.guide == guide:
            return state  # its guide did not compile: it ends
        if state is None or state.guide != guide or not _continues(state, outputs):
            if state is not None or outputs:
                self.rebuilt += 1
            state = _Matcher(guide, _xgr().GrammarMatcher(self.compiler.compile(guide)))
            self._matchers[request_id] = state
        self._matchers.move_to_end(request_id)
        for token in outputs[state.fed :]:
            state.fed, state.last = state.fed + 1, token
            if state.matcher is not None and not state.broken and not state.matcher.accept_token(token):
                state.broken = True  # not one the mask allowed (a stop token the user gave...)
        while len(self._matchers) > MATCHERS:
            self._matchers.popitem(last=False)
        return state

    def forget(self, request_id: str) -> None:
        """Drop a request's matcher (it ended; one kept would be rebuilt if it came back)."""
        self._matchers.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._matchers)


def _continues(state: _Matcher, outputs: Sequence[int]) -> bool:
    return len(outputs) >= state.fed and (state.fed == 0 or outputs[state.fed - 1] == state.last)
