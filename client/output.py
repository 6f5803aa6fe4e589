"""A command's stdout carries its output alone: Ray prints its processes' log lines (raylet
warnings among them) to the driver's ``sys.stdout``, from threads of its own and at exit, and the
processes it starts (the raylet, the GCS) inherit file descriptor 1. So while a command runs
``sys.stdout`` is stderr, and the command's own output goes through :func:`emit` to the real
stdout; in the ``tandem`` process itself that holds until the process exits, for the descriptor
too."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator
from typing import TextIO

_stdout: TextIO | None = None


@contextlib.contextmanager
def command_output(whole_process: bool = False) -> Iterator[None]:
    """``whole_process``: the command is this process's one job (``tandem`` on a shell), so what
    is printed after it (Ray's exit, its threads' last lines) must not reach stdout either: fd 1
    becomes stderr's and stays so, and :func:`emit` writes to a duplicate of the old fd 1."""
    global _stdout
    if whole_process:
        sys.stdout.flush()
        _stdout = open(os.dup(1), "w", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives as long as the process)
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        yield
        return
    previous, _stdout = _stdout, sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _stdout = previous


def emit(text: str = "", end: str = "\n") -> None:
    """Output of the command: a line, or with ``end=""`` a piece of one (a streamed chunk)."""
    print(text, end=end, file=_stdout or sys.stdout, flush=True)
