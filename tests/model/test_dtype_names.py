"""What dtype a rank runs in when nobody says: ``serve``'s default is ``auto``, bfloat16 on a GPU
rank and float32 on a CPU one; a named dtype is kept; an unknown name is refused by name."""

from __future__ import annotations

import pytest

from tandem.cli.main import build_parser
from tandem.model.dtype_names import AUTO, resolved_dtype


def test_serve_and_plan_default_to_auto() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).dtype == AUTO
    assert parser.parse_args(["plan", "memory", "--model", "m", "--preset", "local"]).dtype == AUTO


def test_auto_is_bfloat16_on_a_gpu_and_float32_on_a_cpu() -> None:
    assert resolved_dtype(AUTO, on_gpu=True) == "bfloat16"
    assert resolved_dtype(AUTO, on_gpu=False) == "float32"
    assert resolved_dtype("float64", on_gpu=True) == "float64"
    with pytest.raises(ValueError, match="'fp8'"):
        resolved_dtype("fp8", on_gpu=True)
