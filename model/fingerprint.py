"""A checkpoint's fingerprint: what names its KV in a shared store, so that blocks of one model
are never read as another's. Two directories with the same ``config.json`` and the same weight
files (names, sizes, and their first and last 64 KiB, which hold each file's header and its
last tensors) have the same fingerprint wherever they are; a retrained or requantised
checkpoint has another. Cheap: it reads a few hundred KiB, never the weights."""

from __future__ import annotations

import hashlib
from pathlib import Path

_EDGE_BYTES = 64 << 10


def checkpoint_fingerprint(model_dir: str | Path) -> str:
    """16 hex digits naming the checkpoint in ``model_dir`` (its ``config.json`` and weights)."""
    root = Path(model_dir)
    digest = hashlib.blake2b(digest_size=8)
    digest.update((root / "config.json").read_bytes())
    for path in sorted(root.glob("*.safetensors")):
        size = path.stat().st_size
        digest.update(f"{path.name}:{size}".encode())
        with path.open("rb") as handle:
            digest.update(handle.read(_EDGE_BYTES))
            if size > _EDGE_BYTES:
                handle.seek(max(_EDGE_BYTES, size - _EDGE_BYTES))
                digest.update(handle.read(_EDGE_BYTES))
    return digest.hexdigest()


def kv_model_key(model_dir: str | Path, kernels: str) -> str:
    """What names a rank's KV blocks in the shared store: the checkpoint's fingerprint, the FP8
    activation mode (``TANDEM_FP8_ACTIVATIONS``: ``quant`` rounds the activations that meet FP8
    weights, so the KV differs) and the kernel backend (``kernels``: each rounds in its own way).
    Ranks that differ in any of them never read each other's blocks."""
    from tandem.model.kernels.fp8 import fp8_mode  # torch: only ranks ask for this

    return f"{checkpoint_fingerprint(model_dir)}-{fp8_mode()}-{kernels}"
