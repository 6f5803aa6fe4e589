"""The multi-token-prediction layer against ``transformers``: its decoder layer (MLA attention
over its own KV in the pool's layer N, and the MoE block) and head give, at every row, the
logits Hugging Face's DeepSeek-V3 layer gives on the same weights, whether the rows came in one
prefill, an extend over earlier rows, or one absorbed decode row. Its checkpoint tensors load
only when asked for, and a wrong one is named."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tandem.model.attention_metadata import AttentionMetadata
from tandem.model.checkpoint import CheckpointError, check_model_dir, load_checkpoint
from tandem.model.config import ModelConfig
from tandem.model.deepseek import DeepseekV3
from tandem.model.kv_pool import KVPool
from tandem.model.make_tiny import make_tiny_checkpoint, tiny_config_dict, write_checkpoint


@pytest.fixture(scope="module")
def tiny_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("mtp") / "tiny", seed=1, num_nextn_predict_layers=1)


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _hf_layer_logits(path: Path, cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    """Hugging Face's one-layer DeepSeek-V3 whose layer is the MTP layer's decoder layer, whose
    final norm and head are its ``shared_head``: fed the MTP layer's input ``x``, its logits."""
    import transformers

    raw = tiny_config_dict(num_hidden_layers=1, first_k_dense_replace=0)
    hf = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**raw)).float().eval()
    tensors = load_checkpoint(path, cfg, torch.float32, mtp=True)
    n = f"model.layers.{cfg.num_hidden_layers}."
    state = {
        "model.layers.0." + k.removeprefix(n): v
        for k, v in tensors.items()
        if k.startswith(n)
        and not k.removeprefix(n).startswith(("embed_tokens", "enorm", "hnorm", "eh_proj", "shared"))
    }
    experts = "model.layers.0.mlp.experts."
    count = cfg.n_routed_experts  # transformers holds the routed experts stacked
    gate_up = [
        torch.cat([state.pop(f"{experts}{e}.gate_proj.weight"), state.pop(f"{experts}{e}.up_proj.weight")])
        for e in range(count)
    ]
    state[experts + "gate_up_proj"] = torch.stack(gate_up)
    state[experts + "down_proj"] = torch.stack(
        [state.pop(f"{experts}{e}.down_proj.weight") for e in range(count)]
    )
    state["model.norm.weight"] = tensors[n + "shared_head.norm.weight"]
    state["lm_head.weight"] = tensors[n + "shared_head.head.weight"]
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) == {"model.embed_tokens.weight"}, (missing, unexpected)
    with torch.no_grad():
        return hf(inputs_embeds=x[None]).logits[0]


def test_the_mtp_layer_gives_transformers_logits_in_prefill_extend_and_decode(tiny_mtp: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_mtp)
    model = DeepseekV3(cfg, torch.float32, mtp=True)
    model.load_weights(load_checkpoint(tiny_mtp, cfg, torch.float32, mtp=True))
    assert model.mtp is not None and model.num_kv_layers == cfg.num_hidden_layers + 1
    gen = torch.Generator().manual_seed(3)
    length = 19
    tokens = torch.randint(0, cfg.vocab_size, (length,), generator=gen)
    hidden = torch.randn(length, cfg.hidden_size, generator=gen)
    mtp = model.mtp
    e = F.embedding(tokens, mtp.embed_tokens)
    e[0] = 0.0  # position 0
    x = F.linear(
        torch.cat(
            [_rms(e, mtp.enorm.weight, mtp.enorm.eps), _rms(hidden, mtp.hnorm.weight, mtp.hnorm.eps)], -1
        ),
        mtp.eh_proj.weight,
    )
    ref = _hf_layer_logits(tiny_mtp, cfg, x)

    page = 4
    pool = KVPool(cfg, 16, page, torch.float32, num_layers=model.num_kv_layers)
    pages = [9, 2, 14, 5, 11]
    out = []
    for start, end in [(0, 7), (7, 18), (18, 19)]:  # prefill, extend, one decode row
        meta = AttentionMetadata.build(page, [end - start], [end], [pages])
        g = model.mtp_forward(tokens[start:end], torch.arange(start, end), hidden[start:end], meta, pool)
        out.append(model.mtp_logits(g))
    ours = torch.cat(out)
    assert float((ours - ref).abs().max() / ref.abs().max()) < 1e-4
    assert not pool.kv[: cfg.num_hidden_layers].any()  # the main layers' KV is untouched


def test_mtp_tensors_load_only_when_asked_and_a_wrong_one_is_named(tiny_mtp: Path, tmp_path: Path) -> None:
    cfg = ModelConfig.from_dir(tiny_mtp)
    plain = load_checkpoint(tiny_mtp, cfg, torch.float32)
    assert not any(k.startswith(f"model.layers.{cfg.num_hidden_layers}.") for k in plain)
    with pytest.raises(CheckpointError, match="no multi-token-prediction layer"):
        check_model_dir(make_tiny_checkpoint(tmp_path / "plain", seed=0), mtp=True)
    tensors = load_checkpoint(tiny_mtp, cfg, torch.float32, mtp=True)
    name = f"model.layers.{cfg.num_hidden_layers}.eh_proj.weight"
    tensors[name] = tensors[name][:, : cfg.hidden_size].contiguous()
    write_checkpoint(tmp_path / "bad", tiny_config_dict(num_nextn_predict_layers=1), tensors)
    (tmp_path / "bad" / "tokenizer.json").write_bytes((tiny_mtp / "tokenizer.json").read_bytes())
    (tmp_path / "bad" / "tokenizer_config.json").write_bytes(
        (tiny_mtp / "tokenizer_config.json").read_bytes()
    )
    check_model_dir(tmp_path / "bad")  # without MTP the layer is not read
    with pytest.raises(CheckpointError, match=rf"tensor '{name}' has shape \[64, 64\], expected \[64, 128\]"):
        check_model_dir(tmp_path / "bad", mtp=True)
