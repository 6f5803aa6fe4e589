"""What names a rank's KV in the shared store: the checkpoint, and what else changes its KV."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.model.fingerprint import kv_model_key


def test_the_store_key_of_a_rank_differs_with_the_fp8_mode_and_the_kernel_backend(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3"}')
    (tmp_path / "model.safetensors").write_bytes(b"weights" * 100)
    monkeypatch.delenv("TANDEM_FP8_ACTIVATIONS", raising=False)
    default = kv_model_key(tmp_path, "torch")
    monkeypatch.setenv("TANDEM_FP8_ACTIVATIONS", "dequant")
    assert kv_model_key(tmp_path, "torch") == default  # unset is dequant
    monkeypatch.setenv("TANDEM_FP8_ACTIVATIONS", "quant")
    assert kv_model_key(tmp_path, "torch") != default
    monkeypatch.delenv("TANDEM_FP8_ACTIVATIONS")
    assert kv_model_key(tmp_path, "triton") != default
    (tmp_path / "config.json").write_text('{"model_type": "deepseek_v3", "x": 1}')
    assert kv_model_key(tmp_path, "torch") != default
