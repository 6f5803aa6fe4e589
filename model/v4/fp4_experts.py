"""A DeepSeek-V4 checkpoint's routed experts rewritten in FP4, the format V4's releases ship them
in (``kernels/fp4.py``: ``I8`` pairs of e2m1 numbers, low nibble first, and one ``F8_E8M0``
scale per 32 inputs under ``<module>.scale``; ``config.json`` says ``"expert_dtype": "fp4"``),
and beside it, on request, its **dequantised twin**: the source with its experts replaced by
exactly the values the FP4 bytes hold, in the source's dtype. A model that keeps the experts
FP4 must give the twin's tokens (the torch kernels multiply the same numbers; the Triton ones
up to summation order).

The source's experts are unquantised or FP8 with block scales (dequantised first); everything
else is copied as it is (FP8 attention stays FP8). The twin of an FP8 source is refused: its
experts would have to be FP8 again, which cannot hold the FP4 values' 32-wide scales. Shard by
shard, into a directory beside the destination that is renamed into place when whole: a
destination is never half-written, and one that exists is refused."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tandem.model.checkpoint import INDEX_FILE
from tandem.model.kernels.fp4 import dequantize_fp4, quantize_fp4
from tandem.model.kernels.fp8 import dequantize_fp8_block
from tandem.model.v4.config import V4Config
from tandem.model.v4.names import canonical_name, is_fp4_weight


class Fp4ConversionError(ValueError):
    """A conversion refused, naming the argument or file at fault (``flag: why``)."""


def write_fp4_experts(src: Path | str, dst: Path | str, twin: Path | str | None = None) -> None:
    """Write ``src``'s checkpoint with FP4 routed experts to ``dst``; with ``twin``, its
    dequantised twin there too."""
    src, dst = Path(src), Path(dst)
    cfg = V4Config.from_dir(src)
    if cfg.expert_dtype == "fp4":
        raise Fp4ConversionError(f"SRC: {src}'s routed experts are FP4 already")
    if twin is not None and cfg.quant_block_size is not None:
        raise Fp4ConversionError(
            f"--twin: {src} is FP8; a twin's experts would be FP8 again, which cannot hold the FP4 "
            "values exactly (convert an unquantised checkpoint to get one)"
        )
    outs = [(Path(d), kind) for d, kind in ((dst, "fp4"), (twin, "twin")) if d is not None]
    for out, _ in outs:
        if out.exists():
            raise Fp4ConversionError(f"{'DST' if out == dst else '--twin'}: {out} exists")
    raw = json.loads((src / "config.json").read_text())
    fp4_cfg = V4Config.from_dict(raw | {"expert_dtype": "fp4"})
    stagings = [_staging(out) for out, _ in outs]
    try:
        files = sorted(src.glob("*.safetensors"))
        if not files:
            raise Fp4ConversionError(f"SRC: {src} holds no .safetensors file")
        maps: list[dict[str, str]] = [{} for _ in outs]
        for file in files:
            tensors = _read(file)
            for (_, kind), staging, weight_map in zip(outs, stagings, maps, strict=True):
                converted = _convert(tensors, cfg, fp4_cfg, kind, file)
                save_file(converted, str(staging / file.name), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(converted, file.name))
        for (_, kind), staging, weight_map in zip(outs, stagings, maps, strict=True):
            _copy_rest(src, staging, raw | {"expert_dtype": "fp4"} if kind == "fp4" else raw)
            if (src / INDEX_FILE).is_file():
                index = json.loads((src / INDEX_FILE).read_text())
                index["weight_map"] = dict(sorted(weight_map.items()))
                (staging / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
        for (out, _), staging in zip(outs, stagings, strict=True):
            staging.chmod(0o755)
            os.rename(staging, out)
    finally:
        for staging in stagings:
            if staging.exists():
                shutil.rmtree(staging)


def _staging(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))


def _read(file: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(file), framework="pt") as handle:
        return {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118


def _convert(
    tensors: dict[str, torch.Tensor], cfg: V4Config, fp4_cfg: V4Config, kind: str, file: Path
) -> dict[str, torch.Tensor]:
    """One shard's tensors: each routed expert's weight as FP4 bytes and scale bytes (``fp4``) or
    as the values those hold, in its dtype (``twin``); its FP8 scales dropped."""
    out: dict[str, torch.Tensor] = {}
    dropped: set[str] = set()
    for name, tensor in tensors.items():
        if not is_fp4_weight(canonical_name(name), fp4_cfg):
            continue
        weight = tensor.float()
        if cfg.quant_block_size is not None:  # an FP8 expert: its block scales beside it
            scale_name = next((s for s in _scale_names(name) if s in tensors), None)
            if scale_name is None:
                raise Fp4ConversionError(f"{file}: FP8 expert {name!r} has no scales in the same file")
            weight = dequantize_fp8_block(tensor, tensors[scale_name].float(), cfg.quant_block_size)
            dropped.add(scale_name)
        packed, scale = quantize_fp4(weight)
        if kind == "fp4":
            out[name] = packed.view(torch.int8)
            out[name.removesuffix(".weight") + ".scale"] = scale.view(torch.float8_e8m0fnu)
        else:
            out[name] = dequantize_fp4(packed, scale).to(tensor.dtype)
    for name, tensor in tensors.items():
        if name not in out and name not in dropped:
            out[name] = tensor
    return {name: tensor.contiguous() for name, tensor in out.items()}


def _scale_names(weight: str) -> tuple[str, str]:
    """Where an FP8 weight's block scales are: DeepSeek's name, then transformers'."""
    return weight.removesuffix(".weight") + ".scale", weight + "_scale_inv"


def _copy_rest(src: Path, staging: Path, config: dict[str, object]) -> None:
    """``config.json`` (as given) and every other file but the tensors and their index."""
    (staging / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for path in src.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name not in ("config.json", INDEX_FILE):
            shutil.copy2(path, staging / path.name)
    for path in staging.iterdir():  # a model directory is shared like any other
        path.chmod(0o644)
