"""The DeepSeek-V3 model over a ragged batch that reads and writes the paged latent KV pool.

Numerically it follows Hugging Face ``DeepseekV3ForCausalLM``: RMSNorm statistics, the router
and the RoPE table in float32 whatever the activation dtype; everything else in the model dtype.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tandem.model.attention_metadata import AttentionMetadata
from tandem.model.config import ModelConfig
from tandem.model.expert_dispatch import ExpertDispatcher, LocalExperts
from tandem.model.kernels.backend import KernelBackend
from tandem.model.kernels.fp8 import FP8_DTYPE, quantize_fp8_block
from tandem.model.kernels.registry import get_backend
from tandem.model.kernels.rope import rope_cos_sin_table
from tandem.model.kv_pool import KVPool
from tandem.model.layers import DecoderLayer, Linear, MoE, RMSNorm
from tandem.model.mtp import MTPLayer

# the MTP layer's own tensors (``model.layers.N.<name>``) -> its parameters
_MTP_NAMES = {
    "embed_tokens.weight": "mtp.embed_tokens",
    "enorm.weight": "mtp.enorm.weight",
    "hnorm.weight": "mtp.hnorm.weight",
    "eh_proj.weight": "mtp.eh_proj.weight",
    "shared_head.norm.weight": "mtp.shared_head_norm.weight",
    "shared_head.head.weight": "mtp.shared_head",
}


class DeepseekV3(nn.Module):
    """``experts`` is the range of routed experts this copy holds (all of them by default); with a
    slice, ``dispatcher`` must bring the other experts' outputs from the ranks that hold them."""

    def __init__(
        self,
        cfg: ModelConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        ops: KernelBackend | None = None,
        experts: range | None = None,
        dispatcher: ExpertDispatcher | None = None,
        mtp: bool = False,
        keep_fp8: bool = True,
    ) -> None:
        """``mtp``: hold the checkpoint's multi-token-prediction layer too (``model/mtp.py``),
        whose attention uses the KV pool's layer ``num_hidden_layers``. ``keep_fp8``: an FP8
        checkpoint's projections and experts stay FP8 in memory (``layers.py``); without it,
        or for a checkpoint that is not FP8, every weight is in ``dtype``."""
        super().__init__()
        self.cfg = cfg
        self.dtype = dtype
        self.device = torch.device(device)
        self.ops = ops or get_backend(self.device)
        self.experts = experts if experts is not None else range(cfg.n_routed_experts)
        if dispatcher is None and len(self.experts) != cfg.n_routed_experts:
            raise ValueError("a model holding a slice of the experts needs an expert-parallel dispatcher")
        self.dispatcher = dispatcher or LocalExperts()
        self.fp8_block = cfg.quant_block_size if keep_fp8 else None
        fp8 = self.fp8_block
        self.embed_tokens = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, i, dtype, device, self.experts, fp8) for i in range(cfg.num_hidden_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        if mtp and cfg.num_nextn_predict_layers < 1:
            raise ValueError("the model's config.json has no multi-token-prediction layer")
        self.mtp = MTPLayer(cfg, dtype, device, self.experts, fp8) if mtp else None
        self.lm_head = nn.Parameter(
            torch.empty(cfg.vocab_size, cfg.hidden_size, dtype=dtype, device=device), requires_grad=False
        )
        cos, sin = rope_cos_sin_table(cfg.rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
        self.rope_cos: torch.Tensor
        self.rope_sin: torch.Tensor
        self.register_buffer("rope_cos", cos.to(device), persistent=False)
        self.register_buffer("rope_sin", sin.to(device), persistent=False)
        for module in self.modules():
            if isinstance(module, Linear) and module.fp8_block is not None:
                module.ops = self.ops
        self._fp8_params: set[str] | None = None

    def weight_bytes(self) -> int:
        """Bytes of weights resident on this copy's device (FP8 weights count 1 byte, their
        scales 4 bytes per block)."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def keeps_fp8(self, name: str) -> bool:
        """Whether the Hugging Face tensor ``name`` is held as FP8 here (then the checkpoint's
        FP8 bytes and its ``_scale_inv`` load as they are)."""
        if self._fp8_params is None:
            self._fp8_params = {n for n, p in self.named_parameters() if p.dtype == FP8_DTYPE}
        target, _ = self._target(name)
        return target in self._fp8_params

    def owns_expert(self, layer: int, expert: int) -> bool:
        return expert in self.experts

    @property
    def num_kv_layers(self) -> int:
        """Layers of the KV pool this model reads and writes: its decoder layers, and the MTP
        layer's when it holds one."""
        return self.cfg.num_hidden_layers + (1 if self.mtp is not None else 0)

    @torch.inference_mode()
    def mtp_forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        pool: KVPool,
        on_layer_kv: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """The MTP layer over packed rows (``model/mtp.py``): ``g [T, hidden]``."""
        if self.mtp is None:
            raise ValueError("this model was built without its MTP layer (mtp=True)")
        cos = self.rope_cos[positions].to(self.dtype)
        sin = self.rope_sin[positions].to(self.dtype)
        return self.mtp(
            input_ids, positions, hidden, cos, sin, meta, pool, self.ops, self.dispatcher, on_layer_kv
        )

    @torch.inference_mode()
    def mtp_logits(self, g: torch.Tensor) -> torch.Tensor:
        assert self.mtp is not None
        return self.mtp.compute_logits(g, self.ops)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        pool: KVPool,
        on_layer_kv: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, hidden]`` after the final norm for the packed new tokens.

        ``on_layer_kv(layer)`` is called as soon as a layer's new KV is in the pool, before that
        layer's MLP and the later layers run: a prefill rank posts that layer's transfer there,
        so the transfer overlaps the rest of the forward.
        """
        ops = self.ops
        x = F.embedding(input_ids, self.embed_tokens)
        cos = self.rope_cos[positions].to(self.dtype)
        sin = self.rope_sin[positions].to(self.dtype)
        residual: torch.Tensor | None = None
        for layer in self.layers:
            assert isinstance(layer, DecoderLayer)
            h, residual = ops.rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps, residual)
            x = layer.self_attn(h, cos, sin, pool.layer(layer.index), meta, ops)
            if on_layer_kv is not None:
                on_layer_kv(layer.index)
            h, residual = ops.rms_norm(
                x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps, residual
            )
            x = layer.mlp(h, ops, self.dispatcher) if isinstance(layer.mlp, MoE) else layer.mlp(h)
        return ops.rms_norm(x, self.norm.weight, self.norm.eps, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)

    def expert_filter(self) -> Callable[[int, int], bool]:
        return self.owns_expert

    @torch.inference_mode()
    def load_weights(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy Hugging Face-named tensors in, one at a time as they come (``checkpoint.
        iter_checkpoint``); routed experts are stacked into ``w_gate_up``/``w_down``. An FP8
        destination takes FP8 bytes and their ``_scale_inv`` as they are; given a tensor that is
        not FP8, it quantises it by blocks (with its scale) on the way in."""
        own = dict(self.named_parameters())
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        for name, tensor in items:
            dst = self._destination(own, name)
            if dst is None:
                continue
            if dst.dtype == FP8_DTYPE and tensor.dtype != FP8_DTYPE and not name.endswith("_scale_inv"):
                assert self.fp8_block is not None
                tensor, scale = quantize_fp8_block(tensor, self.fp8_block)
                scale_dst = self._destination(own, name + "_scale_inv")
                assert scale_dst is not None
                self._copy(name + "_scale_inv", scale_dst, scale)
            self._copy(name, dst, tensor)
        if self.cfg.tie_word_embeddings:
            self.lm_head.copy_(self.embed_tokens)

    def _destination(self, own: dict[str, nn.Parameter], name: str) -> torch.Tensor | None:
        target, index = self._target(name)
        if target is None:
            return None
        param = own.get(target)
        if param is None:
            if name.endswith("_scale_inv"):
                base = name.removesuffix("_scale_inv")
                raise ValueError(f"tensor {name}: the model holds {base} unquantised")
            raise ValueError(f"tensor {name}: the model has no parameter {target}")
        dst: torch.Tensor = param if index is None else param[index[0]]
        if index is not None and index[1] is not None:
            dst = dst[index[1]]
        return dst

    @staticmethod
    def _copy(name: str, dst: torch.Tensor, tensor: torch.Tensor) -> None:
        if dst.shape != tensor.shape:
            raise ValueError(f"tensor {name}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor.to(dst.dtype))

    def _target(self, name: str) -> tuple[str | None, tuple[int, slice | None] | None]:
        """Where a Hugging Face tensor goes: (parameter name, (expert row, slice) or None)."""
        if name == "model.embed_tokens.weight":
            return "embed_tokens", None
        if name == "lm_head.weight":
            return "lm_head", None
        if name == "model.norm.weight":
            return "norm.weight", None
        parts = name.split(".")
        if parts[:2] != ["model", "layers"]:
            return None, None
        layer = int(parts[2])
        rest = ".".join(parts[3:])
        prefix = f"layers.{layer}."
        if layer >= self.cfg.num_hidden_layers:  # the MTP layers: the first one, if held
            if self.mtp is None or layer != self.cfg.num_hidden_layers:
                return None, None
            own = _MTP_NAMES.get(rest)
            if own is not None:
                return own, None
            prefix = "mtp.layer."
        if rest.startswith("mlp.experts."):
            expert, proj = int(parts[5]), parts[6]
            if expert not in self.experts:
                return None, None
            local = expert - self.experts.start
            inter = self.cfg.moe_intermediate_size
            if name.endswith("_scale_inv"):  # FP8 experts: gate's scale rows, then up's
                rows = -(-inter // self.fp8_block[0]) if self.fp8_block else 0
                if proj == "gate_proj":
                    return prefix + "mlp.w_gate_up_scale", (local, slice(0, rows))
                if proj == "up_proj":
                    return prefix + "mlp.w_gate_up_scale", (local, slice(rows, 2 * rows))
                return prefix + "mlp.w_down_scale", (local, None)
            if proj == "gate_proj":
                return prefix + "mlp.w_gate_up", (local, slice(0, inter))
            if proj == "up_proj":
                return prefix + "mlp.w_gate_up", (local, slice(inter, 2 * inter))
            return prefix + "mlp.w_down", (local, None)
        if rest == "mlp.gate.weight":
            return prefix + "mlp.gate_weight", None
        if rest == "mlp.gate.e_score_correction_bias":
            return prefix + "mlp.e_score_correction_bias", None
        return prefix + rest, None
