"""The whole tiny model through ``tandem generate`` with the Triton kernels (Triton's interpreter on
CPU) gives token for token the torch backend's greedy output."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tandem.bench.gpu_check import main as gpu_check_main
from tandem.cli.main import main
from tandem.model.kernels.registry import UnknownKernelBackend, get_backend
from tandem.model.make_tiny import make_tiny_checkpoint


def _generate(
    tiny: Path,
    prompts: Path,
    kernels: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> list[list[int]]:
    monkeypatch.setenv("TANDEM_KERNELS", kernels)
    args = ["generate", "--model", str(tiny), "--prompts-file", str(prompts), "--max-tokens", "8"]
    assert main([*args, "--ignore-eos", "--page-size", "8", "--json"]) == 0
    return [o["token_ids"] for o in json.loads(capsys.readouterr().out)["outputs"]]


def test_triton_kernels_give_the_torch_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    tiny = make_tiny_checkpoint(tmp_path / "tiny")
    prompts = tmp_path / "prompts.jsonl"
    lines = [
        {"prompt": "Hello, Tandem"},  # 14 tokens: crosses a page of 8
        {"prompt_ids": [5, 6, 7]},
        {"prompt": "The quick brown fox jumps over the lazy dog, twice over."},  # many pages
        {"prompt_ids": [100]},  # a single token: absorbed decode from the first step
    ]
    prompts.write_text("\n".join(json.dumps(line) for line in lines))
    with_triton = _generate(tiny, prompts, "triton", monkeypatch, capsys)
    with_torch = _generate(tiny, prompts, "torch", monkeypatch, capsys)
    assert with_triton == with_torch
    assert all(len(tokens) == 8 for tokens in with_torch)


def test_backend_selection(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("TANDEM_KERNELS", raising=False)
    assert get_backend("cpu").name == "torch"
    monkeypatch.setenv("TANDEM_KERNELS", "triton")
    assert get_backend("cpu").name == "triton"
    assert get_backend("cpu", "torch").name == "torch"
    monkeypatch.setenv("TANDEM_KERNELS", "cutlass")
    with pytest.raises(UnknownKernelBackend, match="cutlass"):
        get_backend("cpu")


def test_gpu_check_runs_on_tiny_shapes(capsys: pytest.CaptureFixture[str]) -> None:
    """The GPU check script's harness, on CPU in the interpreter: every kernel checked and listed."""
    assert gpu_check_main(["--shapes", "tiny", "--dtype", "float32", "--max-rel-err", "1e-4"]) == 0
    table = capsys.readouterr().out
    # MLA decode with the default tiles and with the tuning table's (the H200's off a GPU)
    assert "| mla_decode[16h x 16] " in table and "| mla_decode[64h x 16] " not in table  # fp32: wide
    assert "of H200 roofline" in table and "targets: " in table
    for kernel in (
        "mla_extend",
        "kv_store",
        "rms_norm+residual",
        "rope",
        "rope_kv_store",
        "moe_route",
        "moe_gate_route",
        "moe_gate_route_two_steps",
        "moe_experts",
        "moe_experts_clipped",
        "moe_experts_fp4",
        "v4_sparse_attention_decode",
        "v4_sparse_attention_prefill",
        "v4_indexer_topk_decode",
        "v4_indexer_topk_prefill",
        "v4_compress_csa",
        "v4_compress_indexer",
        "v4_compress_hca",
    ):
        assert f"| {kernel} " in table
