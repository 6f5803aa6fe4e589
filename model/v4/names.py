"""DeepSeek-V4's tensor names, as DeepSeek publishes them and transformers' ``save_pretrained``
writes them for ``DeepseekV4ForCausalLM`` (``layers.N.attn.wq_a.weight``,
``layers.N.attn.compressor.wkv.weight``, ``layers.N.attn.indexer.weights_proj.weight``,
``layers.N.ffn.experts.E.w1.weight``, ``layers.N.hc_attn_fn``, ``layers.N.attn.attn_sink``,
``layers.N.ffn.gate.tid2eid`` ...), optionally under transformers' ``model.`` prefix, and the
parameters of :class:`~tandem.model.v4.model.DeepseekV4` they load into."""

from __future__ import annotations

import re

from tandem.model.kernels.fp4 import fp4_shapes
from tandem.model.kernels.fp8 import scale_shape
from tandem.model.v4.config import CSA, V4Config

# top-level names -> parameters, every spelling
_TOP = {
    "embed.weight": "embed",
    "embed_tokens.weight": "embed",
    "head.weight": "head",
    "lm_head.weight": "head",
    "norm.weight": "norm",
    "hc_head_fn": "hc_head.fn",
    "hc_head_base": "hc_head.base",
    "hc_head_scale": "hc_head.scale",
    "hc_head.hc_fn": "hc_head.fn",
    "hc_head.hc_base": "hc_head.base",
    "hc_head.hc_scale": "hc_head.scale",
}
# a layer's names (after ``layers.N.``) -> its parameters
_LAYER = {
    "attn_norm.weight": "attn_norm",
    "ffn_norm.weight": "ffn_norm",
    **{f"hc_{part}_{w}": f"hc_{part}.{w}" for part in ("attn", "ffn") for w in ("fn", "base", "scale")},
    "attn.wq_a.weight": "attn.wq_a",
    "attn.q_norm.weight": "attn.q_norm",
    "attn.wq_b.weight": "attn.wq_b",
    "attn.wkv.weight": "attn.wkv",
    "attn.norm.weight": "attn.kv_norm",
    "attn.kv_norm.weight": "attn.kv_norm",
    "attn.wo_a.weight": "attn.wo_a",
    "attn.wo_b.weight": "attn.wo_b",
    "attn.attn_sink": "attn.attn_sink",
    **{f"attn.{c}.wkv.weight": f"attn.{c}.wkv" for c in ("compressor", "indexer.compressor")},
    **{f"attn.{c}.wgate.weight": f"attn.{c}.wgate" for c in ("compressor", "indexer.compressor")},
    **{f"attn.{c}.ape": f"attn.{c}.ape" for c in ("compressor", "indexer.compressor")},
    **{f"attn.{c}.norm.weight": f"attn.{c}.norm" for c in ("compressor", "indexer.compressor")},
    "attn.indexer.wq_b.weight": "attn.indexer.wq_b",
    "attn.indexer.weights_proj.weight": "attn.indexer.weights_proj",
    "ffn.gate.weight": "ffn.gate_weight",
    "ffn.gate.bias": "ffn.gate_bias",
    "ffn.gate.tid2eid": "ffn.tid2eid",
    "ffn.shared_experts.w1.weight": "ffn.w1",
    "ffn.shared_experts.w2.weight": "ffn.w2",
    "ffn.shared_experts.w3.weight": "ffn.w3",
}
# the projections an FP8 checkpoint holds in FP8 (each with its block scales); the compressors',
# the indexer's head weights and the router stay as they are
_FP8_LAYER_WEIGHTS = (
    "attn.wq_a.weight",
    "attn.wq_b.weight",
    "attn.wkv.weight",
    "attn.wo_a.weight",
    "attn.wo_b.weight",
    "attn.indexer.wq_b.weight",
    "ffn.shared_experts.w1.weight",
    "ffn.shared_experts.w2.weight",
    "ffn.shared_experts.w3.weight",
)
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")
# the MTP layer's own tensors (``mtp.0.``; its block's are a layer's) -> parameters
_MTP_NAME = re.compile(r"^mtp\.0\.(.+)$")
_MTP_TOP = {
    "enorm.weight": "mtp.enorm",
    "hnorm.weight": "mtp.hnorm",
    "norm.weight": "mtp.norm",
    "e_proj.weight": "mtp.e_proj",
    "h_proj.weight": "mtp.h_proj",
    "hc_head_fn": "mtp.hc_head.fn",
    "hc_head_base": "mtp.hc_head.base",
    "hc_head_scale": "mtp.hc_head.scale",
}
_EXPERT = re.compile(r"^ffn\.experts\.(\d+)\.(w[123])\.weight$")


def canonical_name(name: str) -> str:
    """DeepSeek's spelling of a tensor name (transformers' ``model.`` prefix and its names of the
    top-level tensors and the attention's KV norm turned into DeepSeek's)."""
    bare = name.removeprefix("model.")
    top = {"embed_tokens.weight": "embed.weight", "lm_head.weight": "head.weight"}
    top |= {f"hc_head.hc_{w}": f"hc_head_{w}" for w in ("fn", "base", "scale")}
    if bare in top:
        return top[bare]
    if bare.endswith(".weight_scale_inv"):  # transformers' spelling of an FP8 weight's scales
        bare = bare.removesuffix(".weight_scale_inv") + ".scale"
    return bare.replace(".attn.kv_norm.", ".attn.norm.")


def is_fp8_weight(name: str, cfg: V4Config) -> bool:
    """Whether an FP8 checkpoint of ``cfg`` holds tensor ``name`` (DeepSeek's spelling) in FP8,
    with its block scales in ``<module>.scale``."""
    if cfg.quant_block_size is None:
        return False
    mtp = _MTP_NAME.match(name)
    if mtp is not None and mtp.group(1) in ("e_proj.weight", "h_proj.weight"):
        return True
    match = mtp or _LAYER_NAME.match(name)
    if match is None:
        return False
    rest = match.group(match.lastindex or 0)
    return rest in _FP8_LAYER_WEIGHTS or (_EXPERT.match(rest) is not None and cfg.expert_dtype != "fp4")


def is_fp4_weight(name: str, cfg: V4Config) -> bool:
    """Whether tensor ``name`` (DeepSeek's spelling) is a routed expert's weight a checkpoint of
    ``expert_dtype`` ``fp4`` holds in FP4 (``kernels/fp4.py``), with its scale bytes in
    ``<module>.scale``: the main layers' and the MTP layer's."""
    if cfg.expert_dtype != "fp4":
        return False
    match = _MTP_NAME.match(name) or _LAYER_NAME.match(name)
    return match is not None and _EXPERT.match(match.group(match.lastindex or 0)) is not None


def is_fp4_tensor(name: str, cfg: V4Config) -> bool:
    """An FP4 expert's bytes or its scale bytes (any spelling)."""
    canonical = canonical_name(name)
    return is_fp4_weight(
        canonical.removesuffix(".scale") + ".weight" if canonical.endswith(".scale") else canonical, cfg
    )


def parameter_for(name: str, cfg: V4Config) -> tuple[str, int | None, str | None] | None:
    """Where checkpoint tensor ``name`` goes: ``(parameter, routed expert or None, "gate"/"up"
    rows of the expert's stacked gate/up, or None)``; ``None`` for a name of no parameter."""
    bare = canonical_name(name) if name.endswith(".weight_scale_inv") else name.removeprefix("model.")
    if bare.endswith(".scale") and bare.startswith(("layers.", "mtp.")):  # an FP8 weight's block scales
        weight = bare.removesuffix(".scale") + ".weight"
        scaled = is_fp8_weight(weight, cfg) or is_fp4_weight(weight, cfg)
        of = parameter_for(weight, cfg) if scaled else None
        return None if of is None else (of[0] + "_scale", of[1], of[2])
    if bare in _TOP:
        return _TOP[bare], None, None
    mtp = _MTP_NAME.match(bare)
    if mtp is not None:
        rest = mtp.group(1)
        return (_MTP_TOP[rest], None, None) if rest in _MTP_TOP else _layer_parameter("mtp.layer.", rest, cfg)
    match = _LAYER_NAME.match(bare)
    if match is None or int(match.group(1)) >= cfg.num_hidden_layers:
        return None
    return _layer_parameter(f"layers.{match.group(1)}.", match.group(2), cfg)


def _layer_parameter(prefix: str, rest: str, cfg: V4Config) -> tuple[str, int | None, str | None] | None:
    expert = _EXPERT.match(rest)
    if expert is not None:
        e, w = int(expert.group(1)), expert.group(2)
        if e >= cfg.n_routed_experts:
            return None
        if w == "w2":
            return prefix + "ffn.w_down", e, None
        return prefix + "ffn.w_gate_up", e, "gate" if w == "w1" else "up"
    target = _LAYER.get(rest)
    return None if target is None else (prefix + target, None, None)


def expected_v4_tensor_shapes(cfg: V4Config, mtp: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor a V4 checkpoint holds, by DeepSeek's name, with its shape (with ``mtp``, the
    MTP layer's ``mtp.0.*`` too); ``tid2eid`` holds integers, every other tensor floats. An FP8
    checkpoint's FP8 weights (:func:`is_fp8_weight`) each have their block scales,
    ``<module>.scale``; FP4 experts (:func:`is_fp4_weight`) are ``[out, in / 2]`` bytes with
    ``[out, in / 32]`` scale bytes."""
    h, v, n = cfg.hidden_size, cfg.vocab_size, cfg.hc_mult
    shapes: dict[str, tuple[int, ...]] = {"embed.weight": (v, h)}
    for i in range(cfg.num_hidden_layers):
        shapes |= _layer_shapes(cfg, i, f"layers.{i}.")
    shapes |= {"norm.weight": (h,), "hc_head_fn": (n, n * h), "hc_head_base": (n,), "hc_head_scale": (1,)}
    if mtp:  # one more block (sliding window, scored MoE), its glue and its own hyper-head
        shapes |= _layer_shapes(cfg, cfg.num_hidden_layers, "mtp.0.")
        shapes |= {f"mtp.0.{name}.weight": (h,) for name in ("enorm", "hnorm", "norm")}
        shapes |= {f"mtp.0.{name}.weight": (h, h) for name in ("e_proj", "h_proj")}
        shapes |= {"mtp.0.hc_head_fn": (n, n * h), "mtp.0.hc_head_base": (n,), "mtp.0.hc_head_scale": (1,)}
    if not cfg.tie_word_embeddings:
        shapes["head.weight"] = (v, h)
    if cfg.quant_block_size is not None:
        block = cfg.quant_block_size
        shapes |= {
            name.removesuffix(".weight") + ".scale": scale_shape(shape[0], shape[1], block)
            for name, shape in shapes.items()
            if is_fp8_weight(name, cfg)
        }
    for name in [n for n in shapes if is_fp4_weight(n, cfg)]:  # bytes and scale bytes
        shapes[name], shapes[name.removesuffix(".weight") + ".scale"] = fp4_shapes(*shapes[name])
    return shapes


def _layer_shapes(cfg: V4Config, i: int, p: str) -> dict[str, tuple[int, ...]]:
    """Layer ``i``'s tensors under prefix ``p``."""
    h, v, hd, heads = cfg.hidden_size, cfg.vocab_size, cfg.head_dim, cfg.num_attention_heads
    n = cfg.hc_mult
    shapes: dict[str, tuple[int, ...]] = {}
    shapes |= {p + "attn_norm.weight": (h,), p + "ffn_norm.weight": (h,)}
    for part in ("attn", "ffn"):
        shapes |= {p + f"hc_{part}_fn": ((2 + n) * n, n * h), p + f"hc_{part}_base": ((2 + n) * n,)}
        shapes[p + f"hc_{part}_scale"] = (3,)
    a = p + "attn."
    shapes |= {
        a + "wq_a.weight": (cfg.q_lora_rank, h),
        a + "q_norm.weight": (cfg.q_lora_rank,),
        a + "wq_b.weight": (heads * hd, cfg.q_lora_rank),
        a + "wkv.weight": (hd, h),
        a + "norm.weight": (hd,),
        a + "wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, heads * hd // cfg.o_groups),
        a + "wo_b.weight": (h, cfg.o_groups * cfg.o_lora_rank),
        a + "attn_sink": (heads,),
    }
    rate = cfg.compress_rate(i)
    if rate:
        csa = cfg.layer_type(i) == CSA
        shapes |= _compressor_shapes(a + "compressor.", h, hd, rate, csa)
        if csa:
            ihd = cfg.index_head_dim
            shapes |= _compressor_shapes(a + "indexer.compressor.", h, ihd, rate, True)
            shapes[a + "indexer.wq_b.weight"] = (cfg.index_n_heads * ihd, cfg.q_lora_rank)
            shapes[a + "indexer.weights_proj.weight"] = (cfg.index_n_heads, h)
    f = p + "ffn."
    inter = cfg.moe_intermediate_size
    shapes[f + "gate.weight"] = (cfg.n_routed_experts, h)
    if cfg.is_hash_layer(i):
        shapes[f + "gate.tid2eid"] = (v, cfg.num_experts_per_tok)
    else:
        shapes[f + "gate.bias"] = (cfg.n_routed_experts,)
    for e in range(cfg.n_routed_experts):
        shapes |= {f + f"experts.{e}.w1.weight": (inter, h), f + f"experts.{e}.w3.weight": (inter, h)}
        shapes[f + f"experts.{e}.w2.weight"] = (h, inter)
    shapes |= {f + "shared_experts.w1.weight": (inter, h), f + "shared_experts.w3.weight": (inter, h)}
    shapes[f + "shared_experts.w2.weight"] = (h, inter)
    return shapes


def _compressor_shapes(p: str, hidden: int, dim: int, rate: int, overlap: bool) -> dict[str, tuple[int, ...]]:
    width = 2 * dim if overlap else dim
    return {
        p + "wkv.weight": (width, hidden),
        p + "wgate.weight": (width, hidden),
        p + "ape": (rate, width),
        p + "norm.weight": (dim,),
    }
