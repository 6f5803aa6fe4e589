"""A tiny DeepSeek-V3 checkpoint made from a seed, with no download.

The checkpoint is a complete Hugging Face model directory (``config.json``,
``model.safetensors``, ``tokenizer.json``, ``tokenizer_config.json``) that both Tandem and
``transformers.DeepseekV3ForCausalLM`` load, so tests can compare the two on the same weights.
Weights are larger than Hugging Face's initialisation (std 0.02) so that a random model's
greedy output varies from token to token instead of repeating one token.
"""

from __future__ import annotations

import filecmp
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

from tandem.model.checkpoint import INDEX_FILE, SINGLE_FILE
from tandem.model.config import ModelConfig, expected_mtp_tensor_shapes, expected_tensor_shapes
from tandem.model.kernels.fp8 import quantize_fp8_block
from tandem.model.tokenizer import byte_level_alphabet
from tandem.model.v4.config import V4Config
from tandem.model.v4.tiny import quantize_like_deepseek_v4, tiny_v4_config_dict, tiny_v4_weights

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
BOS_ID, EOS_ID = 256, 257

TINY_CONFIG: dict[str, Any] = {
    "vocab_size": 258,
    "hidden_size": 64,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 3,
    "first_k_dense_replace": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 16,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "n_group": 4,
    "topk_group": 2,
    "routed_scaling_factor": 2.5,
    "norm_topk_prob": True,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "rope_interleave": True,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "hidden_act": "silu",
    "initializer_range": 0.02,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "dtype": "float32",
}

# Random weight scales. A projection's std is PROJECTION_GAIN / sqrt(in_features), so each
# layer adds about as much to the residual stream as it receives and the output depends on the
# context; Hugging Face's std 0.02 leaves a tiny model's greedy output repeating a bigram.
EMBED_STD = 1.0
PROJECTION_GAIN = 1.5
NORM_NOISE_STD = 0.05
SCORE_BIAS_STD = 0.01


class TinyCheckpointError(FileExistsError):
    """The output directory already holds something other than this tiny checkpoint."""

    def __init__(self, out_dir: Path, seed: int) -> None:
        super().__init__(
            f"{out_dir}: directory is not empty and does not hold the tiny checkpoint for seed {seed}; "
            "choose an empty or new directory, or delete this one"
        )
        self.out_dir = str(out_dir)


def tiny_config_dict(**overrides: Any) -> dict[str, Any]:
    """Hugging Face ``config.json`` contents of the tiny model; ``rope_theta`` goes into
    ``rope_parameters`` as transformers 5 writes it."""
    raw: dict[str, Any] = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3"}
    raw.update(TINY_CONFIG)
    rope_theta = overrides.pop("rope_theta", 10000.0)
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": float(rope_theta)}
    raw.update(overrides)
    return raw


def tiny_weights(cfg: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Random float32 weights for every tensor of ``cfg``, the same for the same seed (the MTP
    layer's, when ``cfg`` has one, come after the others': the rest is as without it)."""
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    shapes = expected_tensor_shapes(cfg)
    if cfg.num_nextn_predict_layers:
        shapes |= expected_mtp_tensor_shapes(cfg)
    for name, shape in shapes.items():
        noise = torch.randn(shape, generator=generator, dtype=torch.float32)
        if name.endswith("norm.weight"):
            tensors[name] = 1.0 + NORM_NOISE_STD * noise
        elif name.endswith("e_score_correction_bias"):
            tensors[name] = SCORE_BIAS_STD * noise
        elif name == "model.embed_tokens.weight" or name.endswith(".embed_tokens.weight"):
            tensors[name] = EMBED_STD * noise
        elif name.endswith(".bias"):
            tensors[name] = 0.01 * noise
        else:
            tensors[name] = PROJECTION_GAIN / shape[-1] ** 0.5 * noise
    return tensors


def write_checkpoint(
    out_dir: Path | str,
    config_dict: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    shard_max_bytes: int | None = None,
) -> Path:
    """Write ``config.json`` and the tensors as one ``model.safetensors`` or, with
    ``shard_max_bytes``, as shards of at most that size (a larger tensor gets a shard of its
    own) plus ``model.safetensors.index.json``."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
    tensors = {name: t.contiguous() for name, t in tensors.items()}
    if shard_max_bytes is None:
        save_file(tensors, str(out_dir / SINGLE_FILE), metadata={"format": "pt"})
        return out_dir

    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in tensors.items():
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > shard_max_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    weight_map: dict[str, str] = {}
    for i, shard in enumerate(shards):
        file_name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out_dir / file_name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return out_dir


def byte_level_tokenizer() -> Tokenizer:
    """Byte-level tokenizer: id ``b`` is byte ``b`` (in the ByteLevel alphabet), no merges,
    then BOS (256, prepended to every encoding) and EOS (257)."""
    vocab = {char: byte for byte, char in enumerate(byte_level_alphabet())}
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(BOS_TOKEN, special=True), AddedToken(EOS_TOKEN, special=True)])
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS_TOKEN} $A",
        pair=f"{BOS_TOKEN} $A {BOS_TOKEN} $B",
        special_tokens=[(BOS_TOKEN, BOS_ID)],
    )
    return tokenizer


# DeepSeek's chat format, cut down: BOS, the system text, then each turn behind its role marker,
# an assistant turn closed by EOS, and the assistant's marker to generate after
# DeepSeek-V3's chat format with its tool-call markers: the tools described after the BOS, an
# assistant's calls between <｜tool▁calls▁begin｜> and <｜tool▁calls▁end｜> (one a line, the
# arguments as a JSON block), tool results between <｜tool▁outputs▁begin｜> and its end (after
# which the assistant goes on without a new <｜Assistant｜>, as DeepSeek-V3's template has it)
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}{{ '## Tools\\n\\nYou have access to the following tools:\\n' }}"
    "{% for tool in tools %}"
    "{{ '\\n### ' + tool['function']['name'] }}"
    "{{ '\\nDescription: ' + (tool['function']['description'] or '') }}"
    "{{ '\\n\\nParameters: ' + (tool['function']['parameters'] | tojson) + '\\n' }}"
    "{% endfor %}"
    "{{ '\\nIMPORTANT: ALWAYS adhere to this exact format for tool use:\\n' }}"
    "{{ '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>tool_name' }}"
    "{{ '\\n```json\\narguments\\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>\\n\\n' }}"
    "{% endif %}"
    "{% set ns = namespace(tool=false) %}"
    "{% for message in messages %}"
    "{% if message['role'] in ['system', 'developer'] %}{{ message['content'] }}"
    "{% elif message['role'] == 'user' %}"
    "{% if ns.tool %}<｜tool▁outputs▁end｜>{% set ns.tool = false %}{% endif %}"
    "<｜User｜>{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}"
    "{% if ns.tool %}<｜tool▁outputs▁end｜>{% set ns.tool = false %}{% else %}<｜Assistant｜>{% endif %}"
    "{{ message['content'] }}"
    "{% if message['tool_calls'] %}<｜tool▁calls▁begin｜>"
    "{% for call in message['tool_calls'] %}"
    "{% if not loop.first %}{{ '\\n' }}{% endif %}"
    "{{ '<｜tool▁call▁begin｜>' + call['type'] + '<｜tool▁sep｜>' + call['function']['name'] }}"
    "{{ '\\n```json\\n' + call['function']['arguments'] + '\\n```<｜tool▁call▁end｜>' }}"
    "{% endfor %}<｜tool▁calls▁end｜>{% endif %}{{ eos_token }}"
    "{% elif message['role'] == 'tool' %}"
    "{% if not ns.tool %}<｜tool▁outputs▁begin｜>{% set ns.tool = true %}{% endif %}"
    "<｜tool▁output▁begin｜>{{ message['content'] }}<｜tool▁output▁end｜>"
    "{% else %}{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if ns.tool %}<｜tool▁outputs▁end｜>{% elif add_generation_prompt %}<｜Assistant｜>{% endif %}"
)


def write_tokenizer(out_dir: Path) -> None:
    tokenizer = byte_level_tokenizer()
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str(pretty=True) + "\n", encoding="utf-8")
    tok_config = {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "model_max_length": TINY_CONFIG["max_position_embeddings"],
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def quantize_like_deepseek(
    tensors: dict[str, torch.Tensor], block: tuple[int, int]
) -> dict[str, torch.Tensor]:
    """DeepSeek-V3's release format: every 2-D projection and expert weight in FP8 with its
    ``_scale_inv``; embeddings, output heads, norms and the router stay as they are."""
    keep = ("embed_tokens.weight", "lm_head.weight", "mlp.gate.weight", "shared_head.head.weight")
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if tensor.dim() != 2 or name.endswith(keep):
            out[name] = tensor
        else:
            out[name], out[name + "_scale_inv"] = quantize_fp8_block(tensor, block)
    return out


def fp8_quantization_config(block: tuple[int, int]) -> dict[str, Any]:
    return {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [block[0], block[1]],
    }


def make_tiny_checkpoint(
    out_dir: Path | str,
    seed: int = 0,
    fp8_block: tuple[int, int] | None = None,
    arch: str = "deepseek_v3",
    **overrides: Any,
) -> Path:
    """Write the tiny checkpoint for ``seed`` (config fields changed by ``overrides``) to ``out_dir``;
    with ``fp8_block``, in DeepSeek's FP8 format with scales of that block size. ``arch``
    ``deepseek_v4``: a tiny DeepSeek-V4 (``model/v4/tiny.py``) instead.

    The files are written to a temporary directory beside ``out_dir`` and renamed into place, so
    ``out_dir`` is never half-written. If ``out_dir`` already holds the identical checkpoint this
    is a no-op; any other non-empty ``out_dir`` raises :class:`TinyCheckpointError`.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.", dir=out_dir.parent))
    try:
        config_dict, tensors = _tiny_files(arch, seed, fp8_block, overrides)
        if fp8_block is not None:
            config_dict["quantization_config"] = fp8_quantization_config(fp8_block)
            if arch == "deepseek_v4":
                tensors = quantize_like_deepseek_v4(V4Config.from_dict(config_dict), tensors)
            else:
                tensors = quantize_like_deepseek(tensors, fp8_block)
        write_checkpoint(staging, config_dict, tensors)
        write_tokenizer(staging)
        if out_dir.exists() and any(out_dir.iterdir()):
            if not _same_files(staging, out_dir):
                raise TinyCheckpointError(out_dir, seed)
            return out_dir
        # mkdtemp makes a private directory; a model directory is shared like any other.
        staging.chmod(0o755)
        for path in staging.iterdir():
            path.chmod(0o644)
        if out_dir.exists():
            out_dir.rmdir()
        os.rename(staging, out_dir)
        return out_dir
    finally:
        if staging.exists():
            shutil.rmtree(staging)


def _tiny_files(
    arch: str, seed: int, fp8_block: tuple[int, int] | None, overrides: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    if arch == "deepseek_v4":
        config_dict = tiny_v4_config_dict(BOS_ID, EOS_ID, **overrides)
        return config_dict, tiny_v4_weights(V4Config.from_dict(config_dict), seed)
    if arch != "deepseek_v3":
        raise ValueError(f"--arch: expected deepseek_v3 or deepseek_v4, got {arch!r}")
    config_dict = tiny_config_dict(**overrides)
    return config_dict, tiny_weights(ModelConfig.from_dict(config_dict), seed)


def _same_files(a: Path, b: Path) -> bool:
    names = sorted(p.name for p in a.iterdir())
    if names != sorted(p.name for p in b.iterdir()):
        return False
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    return not mismatch and not errors
