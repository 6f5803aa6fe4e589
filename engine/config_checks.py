"""The checks a rank's internal configs make on themselves when built: one error wording for all."""

from __future__ import annotations

import math
from typing import Any


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_positive_ints(config: Any, *names: str) -> None:
    """Raise ``ValueError`` naming the first of ``names`` that is not an integer > 0."""
    for name in names:
        value = getattr(config, name)
        if not _is_int(value) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def check_context(max_model_len: int) -> None:
    if max_model_len < 2:
        raise ValueError(f"max_model_len must be >= 2 (prompt and output), got {max_model_len}")


def check_non_negative_int(name: str, value: Any) -> None:
    if not _is_int(value) or value < 0:
        raise ValueError(f"{name} must be an integer >= 0, got {value!r}")


def check_seconds(name: str, value: Any) -> None:
    """A positive, finite number of seconds."""
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
