"""DeepSeek-V4's MTP layer (``model/v4/mtp.py``) against a reference assembled from transformers'
own V4 modules (transformers does not build the MTP layer; it ignores ``mtp.*`` on load): the
MTP block is loaded into a ``DeepseekV4DecoderLayer`` as an extra sliding-window, scored-MoE
layer; the glue follows DeepSeek's ``MTPBlock`` (``enorm`` of the next token's embedding through
``e_proj``, added to every stream's ``hnorm`` through ``h_proj``, the block, its own hyper-head,
``norm``, the shared head), fed the main model's streams before its hyper-head."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from tandem.model.checkpoint import CheckpointError
from tandem.model.loader import load_model
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.model.v4.attention import LayerState
from tandem.model.v4.model import DeepseekV4

PROMPT = [random.Random(40).randrange(256) for _ in range(40)]  # past the window of 8 and MoE routing
GLUE = ("enorm.", "hnorm.", "norm.", "e_proj.", "h_proj.", "hc_head_")


@pytest.fixture(scope="module")
def mtp_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mtp") / "model"
    return make_tiny_checkpoint(out, seed=5, arch="deepseek_v4", num_nextn_predict_layers=1, hc_mult=4)


def _with_the_block_as_a_layer(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """``src`` with the MTP block stored as one more layer (sliding window, scored MoE) that
    transformers loads; returns the MTP layer's own (glue) tensors."""
    shutil.copytree(src, dst)
    tensors = load_file(src / "model.safetensors")
    config = json.loads((src / "config.json").read_text())
    n = config["num_hidden_layers"]
    out, glue = {}, {}
    for name, tensor in tensors.items():
        if not name.startswith("mtp.0."):
            out[name] = tensor
        elif name.removeprefix("mtp.0.").startswith(GLUE):
            glue[name.removeprefix("mtp.0.")] = tensor
        else:
            out[f"layers.{n}." + name.removeprefix("mtp.0.")] = tensor
    config |= {"num_hidden_layers": n + 1, "num_nextn_predict_layers": 0}
    config["layer_types"] = [*config["layer_types"], "sliding_attention"]
    config["mlp_layer_types"] = [*config["mlp_layer_types"], "moe"]
    (dst / "config.json").write_text(json.dumps(config))
    save_file(out, str(dst / "model.safetensors"))
    return glue


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    h = x.float()
    return (weight.float() * (h * torch.rsqrt(h.square().mean(-1, keepdim=True) + eps))).to(x.dtype)


def _reference_logits(extended: Path, glue: dict[str, torch.Tensor], ids: list[int]) -> torch.Tensor:
    """Row ``p``: the logits of token ``p + 2`` from the main model's streams at ``p`` and token
    ``p + 1`` (rope position ``p``)."""
    from transformers import DeepseekV4ForCausalLM
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HyperHead

    hf: Any = DeepseekV4ForCausalLM.from_pretrained(extended).eval()
    n = hf.config.num_hidden_layers - 1
    captured: dict[str, torch.Tensor] = {}
    hf.model.layers[n - 1].register_forward_hook(lambda _m, _a, out: captured.setdefault("streams", out))
    with torch.no_grad():
        hf(torch.tensor([ids]))
        streams = captured["streams"][:, :-1]  # [1, T, hc, D]
        nxt = torch.tensor([ids[1:]])
        e = F.linear(_rms(hf.model.embed_tokens(nxt), glue["enorm.weight"]), glue["e_proj.weight"])
        x = e.unsqueeze(2) + F.linear(_rms(streams, glue["hnorm.weight"]), glue["h_proj.weight"])
        positions = torch.arange(len(ids) - 1)[None]
        rope = {
            kind: hf.model.rotary_emb(x[:, :, 0], positions, layer_type=kind) for kind in ("main", "compress")
        }
        mask = create_sliding_window_causal_mask(
            config=hf.config,
            inputs_embeds=x[:, :, 0],
            attention_mask=None,
            cache=None,
            position_ids=positions,
        )
        x = hf.model.layers[n](
            x,
            position_embeddings=rope,
            position_ids=positions,
            attention_mask=mask,
            input_ids=nxt,
            cache=None,
        )
        head = DeepseekV4HyperHead(hf.config)
        head.hc_fn.copy_(glue["hc_head_fn"])
        head.hc_base.copy_(glue["hc_head_base"])
        head.hc_scale.copy_(glue["hc_head_scale"])
        return hf.lm_head(_rms(head(x), glue["norm.weight"]))[0]


def _tandem_logits(model: DeepseekV4, ids: list[int], chunk: int) -> torch.Tensor:
    """The MTP layer's logits for every position, the prompt ``chunk`` tokens a call."""
    main, mtp = model.new_state(), LayerState()
    out = []
    for start in range(0, len(ids) - 1, chunk):
        end = min(start + chunk, len(ids) - 1)
        # the main model's streams for positions start..end-1 (it runs one token ahead)
        streams = model(
            torch.tensor(ids[start:end]), torch.arange(start, end), [end - start], [main], before_head=True
        )
        hidden, _ = model.draft(
            streams, torch.tensor(ids[start + 1 : end + 1]), torch.arange(start, end), [end - start], [mtp]
        )
        out.append(model.compute_logits(hidden))
    return torch.cat(out)


def test_the_mtp_layer_gives_the_reference_logits_whatever_the_split(mtp_dir: Path, tmp_path: Path) -> None:
    glue = _with_the_block_as_a_layer(mtp_dir, tmp_path / "extended")
    want = _reference_logits(tmp_path / "extended", glue, PROMPT)
    model = load_model(mtp_dir, torch.float32, "cpu", mtp=True)
    assert model.mtp is not None and model.mtp.layer.attn.rate == 0 and not model.mtp.layer.ffn.hash
    for chunk in (len(PROMPT), 7, 1):
        got = _tandem_logits(model, PROMPT, chunk)
        assert got.shape == want.shape and (got - want).abs().max() < 1e-4, chunk
    # the MTP layer is not the main model: its drafts differ from the main model's next tokens
    main = model.compute_logits(
        model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), [len(PROMPT)], [model.new_state()])
    )
    assert (main[1:].argmax(-1) != want.argmax(-1)).any()


def test_the_mtp_layer_loads_only_when_asked_and_a_missing_tensor_is_named(
    mtp_dir: Path, tmp_path: Path
) -> None:
    assert load_model(mtp_dir, torch.float32, "cpu").mtp is None
    shutil.copytree(mtp_dir, tmp_path / "bad")
    tensors = load_file(mtp_dir / "model.safetensors")
    del tensors["mtp.0.e_proj.weight"]
    save_file(tensors, str(tmp_path / "bad" / "model.safetensors"))
    assert load_model(tmp_path / "bad", torch.float32, "cpu").mtp is None  # not asked for: not read
    with pytest.raises(CheckpointError, match=r"missing tensor 'mtp\.0\.e_proj\.weight'"):
        load_model(tmp_path / "bad", torch.float32, "cpu", mtp=True)


def test_an_fp8_mtp_layer_stays_fp8(tmp_path: Path) -> None:
    path = make_tiny_checkpoint(
        tmp_path / "fp8", seed=5, arch="deepseek_v4", fp8_block=(16, 16), num_nextn_predict_layers=1
    )
    model = load_model(path, torch.float32, "cpu", mtp=True)
    assert model.mtp is not None
    assert (
        model.mtp.e_proj.dtype == torch.float8_e4m3fn
        and model.mtp.layer.attn.wq_a.dtype == torch.float8_e4m3fn
    )
    streams = model(torch.tensor(PROMPT[:9]), torch.arange(9), [9], [model.new_state()], before_head=True)
    hidden, _ = model.draft(streams, torch.tensor(PROMPT[1:10]), torch.arange(9), [9], [LayerState()])
    assert torch.isfinite(hidden).all()
