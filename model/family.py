"""Which DeepSeek family a model directory holds, from its ``config.json`` alone (torch-free):
V4 (``model_type`` ``deepseek_v4``, ``DeepseekV4ForCausalLM``) reads to a
:class:`~tandem.model.v4.config.V4Config`, anything else to V3's
:class:`~tandem.model.config.ModelConfig` (which names what it cannot run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tandem.model.config import ModelConfig, ModelConfigError, read_config_json
from tandem.model.v4.config import V4Config

AnyConfig = ModelConfig | V4Config


def is_v4(raw: dict[str, Any]) -> bool:
    return raw.get("model_type") == "deepseek_v4" or "DeepseekV4ForCausalLM" in (
        raw.get("architectures") or []
    )


def config_from_dict(raw: dict[str, Any], path: Path | str = "config.json") -> AnyConfig:
    return V4Config.from_dict(raw, path) if is_v4(raw) else ModelConfig.from_dict(raw, path)


def read_config(path: Path) -> AnyConfig:
    """A model directory's ``config.json``, or that file given itself."""
    if path.is_dir():
        return config_from_dict(read_config_json(path), path / "config.json")
    if not path.is_file():
        raise ModelConfigError(path, "no such model directory or config.json")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelConfigError(path, f"cannot read it as JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise ModelConfigError(path, "must hold a JSON object")
    return config_from_dict(raw, path)
