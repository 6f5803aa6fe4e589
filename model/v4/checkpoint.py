"""A DeepSeek-V4 checkpoint, checked from its safetensors headers before anything starts, then
read one tensor at a time.

Names are compared in DeepSeek's spelling (``model/v4/names.py``: transformers' ``model.``
prefix and its names of the top-level tensors are the same tensors). Every problem is listed in
one line naming the directory: a missing tensor with its expected shape, one of no parameter,
one of the wrong shape or dtype (``tid2eid`` integers; in an FP8 checkpoint its FP8 weights
``F8_E4M3`` and their block scales ``F32`` or ``F8_E8M0``, DeepSeek's power-of-two scales, read
as float32; in one of ``expert_dtype`` ``fp4`` its routed experts ``I8`` pairs of e2m1 numbers and
their ``F8_E8M0`` scales, read as the bytes they are; every other tensor floats). The MTP
layer's tensors (``mtp.0.*``) are checked and read when it is asked for, and pass unread
otherwise."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.model.checkpoint import CheckpointError, TensorEntry, read_headers
from tandem.model.kernels.fp4 import as_bytes
from tandem.model.v4.config import V4Config
from tandem.model.v4.names import (
    canonical_name,
    expected_v4_tensor_shapes,
    is_fp4_tensor,
    is_fp8_weight,
    parameter_for,
)

_FLOATS = ("F32", "BF16", "F16")
_INTEGERS = ("I64", "I32")
_FP8 = ("F8_E4M3",)
_SCALES = ("F32", "F8_E8M0")
_FP4 = ("I8", "U8")  # two e2m1 numbers a byte
_FP4_SCALES = ("F8_E8M0", "U8")
_LISTED = 10


def check_v4_model_dir(model_dir: Path | str, mtp: bool = False) -> V4Config:
    """``config.json``, the tokenizer and every tensor's name, shape and dtype (no tensor read);
    with ``mtp``, the MTP layer's too."""
    from tandem.model.tokenizer import Tokenizer

    model_dir = Path(model_dir)
    cfg = V4Config.from_dir(model_dir)
    Tokenizer.from_dir(model_dir)
    _problems(model_dir, read_headers(model_dir), cfg, mtp)
    return cfg


def iter_v4_checkpoint(
    model_dir: Path | str, cfg: V4Config, experts: range | None = None, mtp: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor the model loads, one at a time (routed experts outside ``experts`` skipped;
    the MTP layer's only with ``mtp``)."""
    model_dir = Path(model_dir)
    entries = read_headers(model_dir)
    _problems(model_dir, entries, cfg, mtp)
    by_file: dict[Path, list[str]] = {}
    for name, entry in entries.items():
        target = parameter_for(name, cfg)
        if target is None or (experts is not None and target[1] is not None and target[1] not in experts):
            continue
        if not mtp and _is_mtp(name):
            continue
        by_file.setdefault(entry.file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as handle:
            for name in names:
                tensor = handle.get_tensor(name)
                if is_fp4_tensor(name, cfg):  # FP4 bytes and E8M0 scale bytes, kept as bytes
                    yield name, as_bytes(tensor)
                else:
                    yield name, tensor.float() if tensor.dtype == torch.float8_e8m0fnu else tensor


def _allowed_dtypes(canonical: str, cfg: V4Config) -> tuple[str, ...]:
    if canonical.endswith("tid2eid"):
        return _INTEGERS
    if is_fp8_weight(canonical, cfg):
        return _FP8
    if is_fp4_tensor(canonical, cfg):
        return _FP4_SCALES if canonical.endswith(".scale") else _FP4
    scaled = canonical.startswith(("layers.", "mtp.")) and canonical.endswith(".scale")
    if cfg.quant_block_size is not None and scaled:
        return _SCALES
    return _FLOATS


def _is_mtp(name: str) -> bool:
    return name.startswith(("mtp.", "model.mtp."))


def _problems(model_dir: Path, entries: dict[str, TensorEntry], cfg: V4Config, mtp: bool) -> None:
    expected = expected_v4_tensor_shapes(cfg, mtp)
    seen: set[str] = set()
    problems: list[str] = []
    for name, entry in entries.items():
        if not mtp and _is_mtp(name):
            continue
        canonical = canonical_name(name)
        shape = expected.get(canonical)
        if shape is None:
            problems.append(f"unexpected tensor {name!r} with shape {list(entry.shape)}")
            continue
        seen.add(canonical)
        if entry.shape != shape:
            problems.append(f"tensor {name!r} has shape {list(entry.shape)}, expected {list(shape)}")
        allowed = _allowed_dtypes(canonical, cfg)
        if entry.dtype not in allowed:
            problems.append(f"tensor {name!r} has dtype {entry.dtype}, expected {' or '.join(allowed)}")
    problems += [
        f"missing tensor {n!r} (expected shape {list(s)})" for n, s in expected.items() if n not in seen
    ]
    if problems:
        more = len(problems) - _LISTED
        listed = "; ".join(problems[:_LISTED]) + (f"; and {more} more" if more > 0 else "")
        raise CheckpointError(model_dir, f"checkpoint does not match config.json: {listed}")
