"""A command's stdout carries its output alone: Ray prints its processes' log lines (raylet
warnings among them) to the driver's ``sys.stdout``, so while a command runs ``sys.stdout`` is
stderr, and the command's own output goes through :func:`emit` to the real stdout."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import TextIO

_stdout: TextIO | None = None


@contextlib.contextmanager
def command_output() -> Iterator[None]:
    global _stdout
    previous, _stdout = _stdout, sys.stdout
    try:
        with contextlib.redirect_stdout(sys.stderr):
            yield
    finally:
        _stdout = previous


def emit(text: str = "", end: str = "\n") -> None:
    """Output of the command: a line, or with ``end=""`` a piece of one (a streamed chunk)."""
    print(text, end=end, file=_stdout or sys.stdout, flush=True)
