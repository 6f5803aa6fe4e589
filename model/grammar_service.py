"""The frontend's grammar checks, in a process of their own: xgrammar imports torch, and a frontend
never loads torch (``frontend/grammar_checker.py`` starts this module as
``python -m tandem.model.grammar_service MODEL_DIR VOCAB_SIZE LIMIT_S``).

It builds a ``GrammarCompiler`` over the model's tokenizer (its pool of compile threads, its
cache, its time limit), says it is ready, then answers each request as it ends, several at once:
a request is ``(id, guide, field)``, an answer ``(id, error or None, compiled so far)``, both
pickled in ``wire/framing.py``'s frames. Standard output is
the answers' alone: anything else this process prints goes to standard error. It ends when its
standard input does (the frontend stopped or died).
"""

from __future__ import annotations

import concurrent.futures
import os
import sys
import threading
from typing import IO, Any

from tandem.wire.framing import frame, read_frame

# waiting askers at once: the compiler's own queue bounds what compiles; past it, it refuses
ASKERS = 128


def _answer(compiler: Any, out: IO[bytes], lock: threading.Lock, request: tuple[int, Any, str]) -> None:
    request_id, guide, field = request
    error: Exception | None = None
    try:
        compiler.compile(guide, field)
    except ValueError as exc:  # InvalidRequestError and GrammarTimeLimit, naming the field
        error = exc
    with lock:
        out.write(frame((request_id, error, compiler.compiled)))
        out.flush()


def serve(model_dir: str, vocab_size: int, limit_s: float) -> None:
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # what libraries print goes to standard error, not into the answers
    sys.stdout = sys.stderr

    from tandem.model.grammar_compiler import GrammarCompiler
    from tandem.model.tokenizer import Tokenizer

    compiler = GrammarCompiler(Tokenizer.from_dir(model_dir), vocab_size, limit_s)
    compiler.setup()
    lock = threading.Lock()
    with lock:
        answers.write(frame("ready"))
        answers.flush()
    askers = concurrent.futures.ThreadPoolExecutor(ASKERS, thread_name_prefix="grammar-ask")
    while (request := read_frame(sys.stdin.buffer)) is not None:
        askers.submit(_answer, compiler, answers, lock, request)
    os._exit(0)  # a compile cannot be stopped: do not wait for one


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]), float(sys.argv[3]))
