"""The frontend's check that a structured output's spec compiles, without torch in the frontend:
xgrammar imports torch, so the compiles run in a child process (``model/grammar_service.py``:
the rank's ``GrammarCompiler``, its compile threads, its cache and its time limit), started at the
first spec, on a thread (``start_checker``), and talked to over its standard input and output.

``GrammarProcess.check`` sends the spec and awaits its answer without a thread; a reader thread
hands each answer to its asker's future. A spec that does not compile raises the child's
``InvalidRequestError`` (or ``GrammarTimeLimit``) naming the field. If the child dies, every
waiting check fails with ``GrammarTimeLimit`` naming its field (the spec was not checked) and the
next check starts a new child. Its resident size is that of torch and xgrammar (a few hundred MB),
once per frontend that serves a structured output; a frontend that serves none starts nothing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import subprocess
import sys
import threading
from typing import Protocol

from tandem.model.grammar_compiler import GrammarTimeLimit
from tandem.wire.framing import frame, read_frame
from tandem.wire.request_params import Guide

# beyond the child's own limit: its answer on the way, or a child that stopped answering
_SLACK_S = 5.0


class GuideChecker(Protocol):
    async def check(self, guide: Guide, field: str) -> None: ...


class GrammarProcess:
    """Spec checks in a child process (see the module's docstring)."""

    def __init__(self, model_dir: str, vocab_size: int, limit_s: float) -> None:
        self.model_dir, self.vocab_size, self.limit_s = model_dir, vocab_size, limit_s
        self.compiled = 0  # compilations the child has begun (cache misses), as it last said
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._waiting: dict[int, concurrent.futures.Future[Exception | None]] = {}
        self._child: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        """The child, ready (blocks while it loads xgrammar and the vocabulary: call on a thread)."""
        with self._lock:
            if self._child is not None and self._child.poll() is None:
                return
            arguments = [self.model_dir, str(self.vocab_size), str(self.limit_s)]
            child = subprocess.Popen(
                [sys.executable, "-m", "tandem.model.grammar_service", *arguments],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
            )
            assert child.stdout is not None
            if read_frame(child.stdout) != "ready":
                child.kill()
                child.wait()
                raise RuntimeError(f"the grammar checker exited with {child.returncode} before it was ready")
            self._child = child
        threading.Thread(target=self._read, args=(child,), name="grammar-answers", daemon=True).start()

    async def check(self, guide: Guide, field: str) -> None:
        """``InvalidRequestError`` naming ``field`` unless ``guide`` compiles within the limit."""
        if self._child is None or self._child.poll() is not None:
            await asyncio.to_thread(self.start)
        answer: concurrent.futures.Future[Exception | None] = concurrent.futures.Future()
        request_id = next(self._ids)
        with self._lock:
            child = self._child
            assert child is not None and child.stdin is not None
            self._waiting[request_id] = answer
            try:
                child.stdin.write(frame((request_id, guide, field)))
                child.stdin.flush()
            except OSError:
                self._waiting.pop(request_id, None)
                raise GrammarTimeLimit(field, "was not checked: the grammar checker stopped") from None
        try:
            error = await asyncio.wait_for(asyncio.wrap_future(answer), self.limit_s + _SLACK_S)
        except TimeoutError:
            raise GrammarTimeLimit(field, f"was not checked within the limit of {self.limit_s:g} s") from None
        finally:
            with self._lock:
                self._waiting.pop(request_id, None)
        if isinstance(error, GrammarTimeLimit) and error.field != field:
            error = GrammarTimeLimit(field, error.message)
        if error is not None:
            raise error

    def _read(self, child: subprocess.Popen[bytes]) -> None:
        assert child.stdout is not None
        while (answer := read_frame(child.stdout)) is not None:
            request_id, error, compiled = answer
            self.compiled = compiled
            with self._lock:
                waiting = self._waiting.get(request_id)
            if waiting is not None and not waiting.done():
                waiting.set_result(error)
        with self._lock:  # the child ended: nothing more will be answered
            lost = [(i, f) for i, f in self._waiting.items() if not f.done()]
        for _, future in lost:
            with contextlib.suppress(concurrent.futures.InvalidStateError):
                future.set_result(GrammarTimeLimit("guide", "was not checked: the grammar checker stopped"))

    def close(self) -> None:
        with self._lock:
            child, self._child = self._child, None
        if child is not None:
            if child.stdin is not None:
                with contextlib.suppress(OSError):
                    child.stdin.close()  # the child ends at the end of its input
            try:
                child.wait(timeout=5)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()


def start_checker(model_dir: str, vocab_size: int, limit_s: float) -> GuideChecker:
    """The frontend's checker, ready (blocks: call on a thread)."""
    checker = GrammarProcess(model_dir, vocab_size, limit_s)
    checker.start()
    return checker
