"""The one error class for a model directory that Tandem cannot use: it names the file (or the
directory) and what is wrong with it, and crosses process boundaries intact."""

from __future__ import annotations

from pathlib import Path


class ModelFileError(ValueError):
    def __init__(self, path: Path | str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = str(path)
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.path, self.message))
