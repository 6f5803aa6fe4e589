"""Tandem's DeepSeek-V4 against transformers' ``DeepseekV4ForCausalLM`` on tiny checkpoints with
every layer type (CSA, HCA, sliding window), hash and scored MoE layers and a YaRN compress rope:
greedy tokens for prompts of 5 to 300 tokens (crossing sliding windows and both compression
rates' boundaries), 24 new tokens each, whatever the split of the prompt into forward calls.

With an indexer that keeps every entry, transformers is the reference as it is. With a sparse one
(top-k well below the entries) transformers' own V4 is not split-invariant (its ``torch.topk``
picks among tied scores by the matrix's shape): the reference is transformers with ties broken
by the lowest entry index (``tests/hf_v4_reference.py``), Tandem's rule."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tandem.model.kernels import v4_attention as indexer
from tandem.model.kernels.registry import get_backend
from tandem.model.v4.config import CSA, HCA, SLIDING, V4Config
from tandem.model.v4.model import DeepseekV4
from tests.hf_v4_reference import (
    hf_greedy,
    hf_step_logits,
    hf_v4,
    lowest_index_ties,
    tandem_greedy,
    tandem_logits,
    tandem_v4,
    write_tiny_v4,
)

PROMPTS = [[random.Random(n).randrange(256) for _ in range(n)] for n in (5, 17, 64, 131, 300)]
NEW_TOKENS = 24
VARIANTS: dict[str, dict[str, Any]] = {
    "dense-hc2": {},
    "dense-hc4": {"hc_mult": 4, "layer_types": [HCA, SLIDING, CSA, HCA]},
    "sparse": {"index_topk": 3},
}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[DeepseekV4, Any]]:
    out = {}
    for name, overrides in VARIANTS.items():
        directory = tmp_path_factory.mktemp(name) / "model"
        cfg, tensors = write_tiny_v4(directory, seed=3, **overrides)
        out[name] = (tandem_v4(cfg, tensors), hf_v4(directory))
    return out


@pytest.mark.parametrize("variant", ["dense-hc2", "dense-hc4"])
def test_greedy_tokens_equal_transformers_with_a_dense_indexer(models: dict[str, Any], variant: str) -> None:
    tandem, hf = models[variant]
    for prompt in PROMPTS:
        want = hf_greedy(hf, prompt, NEW_TOKENS)
        assert tandem_greedy(tandem, prompt, NEW_TOKENS) == want, len(prompt)
        assert tandem_greedy(tandem, prompt, NEW_TOKENS, chunk=7) == want, len(prompt)


def test_a_sparse_indexer_gives_transformers_tokens_under_the_lowest_index_rule_whatever_the_split(
    models: dict[str, Any],
) -> None:
    tandem, hf = models["sparse"]
    with lowest_index_ties():
        for prompt in PROMPTS:
            want = hf_greedy(hf, prompt, NEW_TOKENS)
            for chunk in (None, 1, 16):
                assert tandem_greedy(tandem, prompt, NEW_TOKENS, chunk=chunk) == want, (len(prompt), chunk)


def test_transformers_own_v4_depends_on_the_split_and_the_tie_rule_makes_it_agree(
    models: dict[str, Any],
) -> None:
    """The reference checked against itself: one forward over the prompt and one token a call
    give different logits (argmax flips) as transformers ships it, the same with the rule."""
    _, hf = models["sparse"]
    ids = PROMPTS[4]
    whole, steps = hf_step_logits(hf, ids, len(ids)), hf_step_logits(hf, ids, 1)
    assert (whole - steps).abs().max() > 0.1 and (whole.argmax(-1) != steps.argmax(-1)).any()
    with lowest_index_ties():
        whole, steps = hf_step_logits(hf, ids, len(ids)), hf_step_logits(hf, ids, 1)
    assert (whole - steps).abs().max() < 1e-4


def test_ties_are_common_and_dropping_the_rule_breaks_split_invariance(
    models: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Most of the indexer's valid scores tie at exactly 0.0 on this model; with ``torch.topk``
    in place of the stable sort, one forward and one token a call no longer agree."""
    tandem, _ = models["sparse"]
    ids = PROMPTS[4]
    scores: list[torch.Tensor] = []
    original = indexer.top_entries

    def watching(total: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
        scores.append(total[visible])
        return original(total, visible, k)

    monkeypatch.setattr(indexer, "top_entries", watching)
    reference = tandem_logits(tandem, ids, len(ids))
    valid = torch.cat(scores)
    assert (valid == 0).float().mean() > 0.1, "too few ties for this test to mean anything"

    def unstable(total: torch.Tensor, visible: torch.Tensor, k: int) -> torch.Tensor:
        masked = total.masked_fill(~visible, float("-inf"))
        order = masked.topk(min(k, total.shape[-1]), dim=-1).indices
        return torch.where(visible.gather(1, order), order, torch.full_like(order, -1))

    assert (tandem_logits(tandem, ids, 1) - reference).abs().max() < 1e-4
    monkeypatch.setattr(indexer, "top_entries", unstable)
    assert (tandem_logits(tandem, ids, 1) - tandem_logits(tandem, ids, len(ids))).abs().max() > 0.1


def test_a_mixed_step_gives_each_request_its_own_logits(models: dict[str, Any]) -> None:
    """A prefill chunk, a decode row and a second chunk in one forward equal each computed alone."""
    tandem, _ = models["sparse"]
    a, b, c = PROMPTS[2], PROMPTS[3], PROMPTS[4]
    alone = [tandem_logits(tandem, p, len(p)) for p in (a, b, c)]
    states = [tandem.new_state() for _ in range(3)]
    # b's first 130 tokens and c's first 100 before; then b decodes its last token while a and
    # the rest of c prefill
    tandem(torch.tensor(b[:130]), torch.arange(130), [130], [states[1]])
    tandem(torch.tensor(c[:100]), torch.arange(100), [100], [states[2]])
    ids = torch.tensor(a + b[130:] + c[100:])
    positions = torch.cat([torch.arange(len(a)), torch.tensor([130]), torch.arange(100, len(c))])
    logits = tandem.compute_logits(tandem(ids, positions, [len(a), 1, len(c) - 100], states))
    assert (logits[: len(a)] - alone[0]).abs().max() < 1e-4
    assert (logits[len(a)] - alone[1][130]).abs().max() < 1e-4
    assert (logits[len(a) + 1 :] - alone[2][100:]).abs().max() < 1e-4


def test_loading_names_a_tensor_of_no_parameter_and_a_wrong_shape(tmp_path: Path) -> None:
    cfg, tensors = write_tiny_v4(tmp_path / "model")
    model = DeepseekV4(cfg)
    with pytest.raises(ValueError, match=r"layers\.0\.attn\.wq_x\.weight: not a DeepSeek-V4 tensor"):
        model.load_weights({"layers.0.attn.wq_x.weight": torch.zeros(1)})
    with pytest.raises(ValueError, match=r"layers\.1\.attn\.wkv\.weight: shape \(3,\), expected \(32, 64\)"):
        model.load_weights({"layers.1.attn.wkv.weight": torch.zeros(3)})
    # transformers' own spellings of the same tensors load too
    renamed = {("model." + k if k.startswith("layers.") else k): v for k, v in tensors.items()}
    renamed["model.embed_tokens.weight"] = renamed.pop("embed.weight")
    model.load_weights(renamed)
    assert torch.equal(model.embed, tensors["embed.weight"])


def test_the_command_writes_a_v4_that_transformers_and_tandem_load_alike(tmp_path: Path) -> None:
    from tandem.cli.main import main

    assert main(["model", "make-tiny", str(tmp_path / "v4"), "--arch", "deepseek_v4", "--seed", "5"]) == 0
    cfg = V4Config.from_dir(tmp_path / "v4")
    tandem = tandem_v4(cfg, load_file(tmp_path / "v4" / "model.safetensors"))
    ids = PROMPTS[2]
    with torch.no_grad():
        want = hf_v4(tmp_path / "v4")(torch.tensor([ids])).logits[0]
    assert (tandem_logits(tandem, ids, len(ids)) - want).abs().max() < 1e-4
    assert main(["model", "make-tiny", str(tmp_path / "v4m"), "--arch", "deepseek_v4", "--mtp"]) == 0
    assert V4Config.from_dir(tmp_path / "v4m").num_nextn_predict_layers == 1
    assert "mtp.0.e_proj.weight" in load_file(tmp_path / "v4m" / "model.safetensors")


def test_the_triton_kernels_give_transformers_tokens_through_every_layer_kind(models: dict[str, Any]) -> None:
    """The sparse model with the Triton backend (Triton's interpreter here): the V4 attention,
    the indexer's stable top-k and the compressor as kernels, against transformers under the
    lowest-index rule: a 64-token prompt (16 CSA entries for a top-3, 4 HCA entries, windows of
    8) and a 17-token one, 10 new tokens each (past two more CSA windows). (The split into
    calls changes only the index lists, built as on the torch path; the kernels' rows are
    checked one by one in ``tests/model/kernels/test_v4_kernels.py``.)"""
    tandem, hf = models["sparse"]
    torch_ops = tandem.ops
    tandem.ops = get_backend("cpu", "triton")
    try:
        with lowest_index_ties():
            for prompt in (PROMPTS[2], PROMPTS[1]):
                assert tandem_greedy(tandem, prompt, 10) == hf_greedy(hf, prompt, 10), len(prompt)
    finally:
        tandem.ops = torch_ops


def test_a_mixed_step_reads_no_device_value_on_the_host(models: dict[str, Any]) -> None:
    """The V4 forward with the Triton kernels (every layer kind, the sparse indexer, a prefill
    chunk and a decode row together) never reads a device value onto the host: what a GPU step
    needs to launch ahead (``engine/host_sync.py``: any such read inside the model raises). (The
    torch backend's experts read their ids back, as V3's do.)"""
    from tandem.engine.host_sync import no_host_sync

    tandem, _ = models["sparse"]
    a, b = PROMPTS[1], PROMPTS[2]
    states = [tandem.new_state() for _ in range(2)]
    tandem(torch.tensor(b[:40]), torch.arange(40), [40], [states[1]])
    ids = torch.tensor(a + b[40:41])
    positions = torch.cat([torch.arange(len(a)), torch.tensor([40])])
    torch_ops = tandem.ops
    tandem.ops = get_backend("cpu", "triton")
    try:
        with no_host_sync(torch.device("cpu")):
            hidden = tandem(ids, positions, [len(a), 1], states)
    finally:
        tandem.ops = torch_ops
    assert hidden.shape == (len(a) + 1, tandem.cfg.hidden_size)
