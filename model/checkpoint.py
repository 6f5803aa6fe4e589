"""Load a Hugging Face DeepSeek-V3 safetensors checkpoint into a flat ``name -> tensor`` dict.

A checkpoint is one ``model.safetensors``, or shards named by ``model.safetensors.index.json``
(``weight_map``: tensor name -> shard file), or, with no index, every ``*.safetensors`` in the
directory. The whole checkpoint is validated from the safetensors headers (names, shapes,
dtypes) before any tensor is read; then only the tensors this process needs are read, lazily.

FP8 block-scaled weights (DeepSeek-V3's release format) carry a companion ``<name>_scale_inv``
of one fp32 number per block; the weight is ``fp8 * scale_inv`` broadcast over its block::

    weight [out, in]                     scale_inv [ceil(out/bo), ceil(in/bi)]
    +--------+--------+----+             +-----+-----+-----+
    | bo x bi| bo x bi|edge|    <---     | s00 | s01 | s02 |
    +--------+--------+----+             +-----+-----+-----+
    |  edge  |  edge  |edge|             | s10 | s11 | s12 |
    +--------+--------+----+             +-----+-----+-----+
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from tandem.model.config import ModelConfig, expected_mtp_tensor_shapes, expected_tensor_shapes
from tandem.model.errors import ModelFileError
from tandem.model.kernels.fp8 import (  # noqa: F401 (re-exported: the checkpoint format's helpers)
    DEFAULT_BLOCK,
    FP8_MAX,
    dequantize_fp8_block,
    quantize_fp8_block,
)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
SCALE_SUFFIX = "_scale_inv"
_MAX_LISTED_PROBLEMS = 10

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F8_E4M3": torch.float8_e4m3fn}

ExpertFilter = Callable[[int, int], bool]

# The MoE router decides discrete expert choices, so it stays in float32 whatever the model dtype,
# as the reference implementation keeps it.
FLOAT32_SUFFIXES = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")


class CheckpointError(ModelFileError):
    """The checkpoint's files do not hold the tensors the config describes."""


@dataclass(frozen=True)
class TensorEntry:
    file: Path
    shape: tuple[int, ...]
    dtype: str


def load_checkpoint(
    model_dir: Path | str,
    cfg: ModelConfig,
    dtype: torch.dtype,
    expert_filter: ExpertFilter | None = None,
    mtp: bool = False,
) -> dict[str, torch.Tensor]:
    """Validate the checkpoint in ``model_dir`` against ``cfg`` and return its tensors in ``dtype``
    (the router's weight and bias in float32).

    Tensors of layers ``>= cfg.num_hidden_layers`` (the multi-token-prediction layers) and rotary
    ``inv_freq`` buffers are ignored; with ``mtp`` the first MTP layer's are loaded too (and must
    be there, with their shapes). ``expert_filter(layer, expert)`` returning False keeps that
    routed expert's tensors out of the result without reading them.
    """
    return dict(iter_checkpoint(model_dir, cfg, dtype, expert_filter, mtp))


def iter_checkpoint(
    model_dir: Path | str,
    cfg: ModelConfig,
    dtype: torch.dtype,
    expert_filter: ExpertFilter | None = None,
    mtp: bool = False,
    keep_fp8: Callable[[str], bool] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """:func:`load_checkpoint`'s tensors one at a time, file by file, each read from its file as
    it is yielded (the host holds one tensor, not a shard). An FP8 tensor for which
    ``keep_fp8(name)`` is true comes as it is, followed by its ``<name>_scale_inv``; every other
    FP8 tensor comes dequantised into ``dtype``. The whole checkpoint is validated first."""
    model_dir = Path(model_dir)
    entries = read_headers(model_dir)
    block = cfg.quant_block_size or DEFAULT_BLOCK
    if mtp and cfg.num_nextn_predict_layers < 1:
        raise CheckpointError(
            model_dir, "has no multi-token-prediction layer (num_nextn_predict_layers is 0 in config.json)"
        )
    wanted = _validate(model_dir, entries, cfg, block, mtp)
    if expert_filter is not None:
        wanted = [name for name in wanted if _keep_expert(name, expert_filter)]

    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(entries[name].file, []).append(name)
    for file, names in by_file.items():
        with safe_open(str(file), framework="pt") as handle:
            for name in names:
                tensor = handle.get_tensor(name)
                if tensor.dtype == torch.float8_e4m3fn:
                    scale_entry = entries[name + SCALE_SUFFIX]
                    if scale_entry.file == file:
                        scale = handle.get_tensor(name + SCALE_SUFFIX)
                    else:
                        with safe_open(str(scale_entry.file), framework="pt") as other:
                            scale = other.get_tensor(name + SCALE_SUFFIX)
                    if keep_fp8 is not None and keep_fp8(name):
                        yield name, tensor
                        yield name + SCALE_SUFFIX, scale.to(torch.float32)
                        continue
                    tensor = dequantize_fp8_block(tensor, scale, block)
                yield name, tensor.to(torch.float32 if name.endswith(FLOAT32_SUFFIXES) else dtype)


def check_model_dir(model_dir: Path | str, mtp: bool = False) -> ModelConfig:
    """Everything a rank will read from ``model_dir``, checked from this process before any rank
    starts: ``config.json``, the tokenizer files, and every tensor's name, shape and dtype from
    the safetensors headers (no tensor is read), the MTP layer's too with ``mtp``. Raises a
    ``ModelFileError`` naming the file."""
    from tandem.model.tokenizer import Tokenizer  # tokenizers is heavy; only this check needs it

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise CheckpointError(model_dir, "model directory does not exist")
    cfg = ModelConfig.from_dir(model_dir)
    Tokenizer.from_dir(model_dir)
    if mtp and cfg.num_nextn_predict_layers < 1:
        raise CheckpointError(
            model_dir, "has no multi-token-prediction layer (num_nextn_predict_layers is 0 in config.json)"
        )
    _validate(model_dir, read_headers(model_dir), cfg, cfg.quant_block_size or DEFAULT_BLOCK, mtp)
    return cfg


def _keep_expert(name: str, expert_filter: ExpertFilter) -> bool:
    match = _EXPERT.match(name)
    return match is None or expert_filter(int(match.group(1)), int(match.group(2)))


def read_headers(model_dir: Path) -> dict[str, TensorEntry]:
    """Name, shape and dtype of every tensor in the checkpoint, from the file headers only."""
    if not model_dir.is_dir():
        raise CheckpointError(model_dir, "model directory does not exist")
    index_path = model_dir / INDEX_FILE
    names_by_file: dict[Path, list[str] | None]  # None: every tensor in the file
    if index_path.is_file():
        names_by_file = dict(_read_index(model_dir, index_path))
    else:
        files = sorted(model_dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(model_dir, f"no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors files")
        names_by_file = dict.fromkeys(files)

    entries: dict[str, TensorEntry] = {}
    for file, names in names_by_file.items():
        try:
            with safe_open(str(file), framework="pt") as handle:
                present = set(handle.keys())
                for name in names if names is not None else sorted(present):
                    if name not in present:
                        raise CheckpointError(index_path, f"{name!r} is mapped to {file.name} but not in it")
                    if name in entries:
                        raise CheckpointError(file, f"{name!r} is also in {entries[name].file.name}")
                    piece = handle.get_slice(name)
                    entries[name] = TensorEntry(file, tuple(piece.get_shape()), piece.get_dtype())
        except (OSError, SafetensorError) as exc:
            raise CheckpointError(file, f"cannot read safetensors file: {exc}") from exc
    return entries


def _read_index(model_dir: Path, index_path: Path) -> dict[Path, list[str]]:
    try:
        weight_map = json.loads(index_path.read_text())["weight_map"]
        items = list(weight_map.items())
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(index_path, f"cannot read the weight_map: {exc!r}") from exc
    names_by_file: dict[Path, list[str]] = {}
    for name, file_name in items:
        shard = model_dir / str(file_name)
        if not shard.is_file():
            raise CheckpointError(
                index_path, f"shard {file_name!r} (holding {name!r}) is missing from {model_dir}"
            )
        names_by_file.setdefault(shard, []).append(name)
    return names_by_file


def _is_ignored(name: str, num_layers: int) -> bool:
    layer = _LAYER.match(name)
    return name.endswith("rotary_emb.inv_freq") or (layer is not None and int(layer.group(1)) >= num_layers)


def _validate(
    model_dir: Path,
    entries: dict[str, TensorEntry],
    cfg: ModelConfig,
    block: tuple[int, int],
    mtp: bool = False,
) -> list[str]:
    """Every problem with the checkpoint, raised together; returns the names to load."""
    expected = expected_tensor_shapes(cfg)
    num_layers = cfg.num_hidden_layers
    if mtp:
        expected |= expected_mtp_tensor_shapes(cfg)
        num_layers += 1
    problems: list[str] = []
    for name, shape in expected.items():
        if name not in entries:
            problems.append(f"missing tensor {name!r} (expected shape {list(shape)})")
    for name, entry in entries.items():
        if _is_ignored(name, num_layers):
            continue
        if name.endswith(SCALE_SUFFIX):
            base = entries.get(name.removesuffix(SCALE_SUFFIX))
            if base is None or base.dtype != "F8_E4M3":
                problems.append(f"unexpected tensor {name!r} with shape {list(entry.shape)} (no FP8 weight)")
            continue
        if name not in expected:
            problems.append(f"unexpected tensor {name!r} with shape {list(entry.shape)}")
            continue
        if entry.shape != expected[name]:
            problems.append(f"tensor {name!r} has shape {list(entry.shape)}, expected {list(expected[name])}")
            continue
        if entry.dtype not in _DTYPES:
            problems.append(f"tensor {name!r} has dtype {entry.dtype}, expected F32, BF16, F16 or F8_E4M3")
        elif entry.dtype == "F8_E4M3":
            problems.extend(_check_scale(name, entry, entries, block))
    if problems:
        listed = "; ".join(problems[:_MAX_LISTED_PROBLEMS])
        more = len(problems) - _MAX_LISTED_PROBLEMS
        suffix = f"; and {more} more" if more > 0 else ""
        raise CheckpointError(model_dir, f"checkpoint does not match config.json: {listed}{suffix}")
    return list(expected)


def _check_scale(
    name: str, entry: TensorEntry, entries: dict[str, TensorEntry], block: tuple[int, int]
) -> list[str]:
    scale = entries.get(name + SCALE_SUFFIX)
    if scale is None:
        return [f"FP8 tensor {name!r} has no {name + SCALE_SUFFIX!r} to dequantise it"]
    if len(entry.shape) != 2:
        return [f"FP8 tensor {name!r} has shape {list(entry.shape)}; only 2-D weights can be block-scaled"]
    out_dim, in_dim = entry.shape
    want = (math.ceil(out_dim / block[0]), math.ceil(in_dim / block[1]))
    if scale.shape != want:
        return [
            f"scale {name + SCALE_SUFFIX!r} has shape {list(scale.shape)}, expected {list(want)} "
            f"for weight shape {list(entry.shape)} with block {list(block)}"
        ]
    return []
