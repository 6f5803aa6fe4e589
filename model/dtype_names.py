"""The dtype names the command line and topologies take, and what ``auto`` means (torch-free)."""

from __future__ import annotations

AUTO = "auto"
NAMES = ("float32", "bfloat16", "float16", "float64")


def resolved_dtype(name: str, on_gpu: bool) -> str:
    """``auto``: bfloat16 on a GPU (the activation dtype DeepSeek-V3 was trained and is served
    in), float32 on a CPU (whose bfloat16 matmuls are slow, and whose runs are checked against
    the float32 reference); any other name as it is."""
    if name == AUTO:
        return "bfloat16" if on_gpu else "float32"
    if name not in NAMES:
        raise ValueError(f"dtype {name!r} is not one of {AUTO}, {', '.join(NAMES)}")
    return name
