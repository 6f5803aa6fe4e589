"""The DeepSeek-V4 model over a step's tokens, request after request, each request carrying its
own state (:class:`~tandem.model.v4.attention.LayerState` per layer) from one forward call to
the next: its tokens are the same whatever the split into calls (``model/v4/indexer.py`` says
how the indexer's ties are broken so that this holds).

Each token's residual is ``hc_mult`` streams (``model/v4/hyper.py``); every layer is attention
then MoE, each wrapped in a hyper-connection; the hyper-head collapses the streams before the
final norm and the head.

Tensors load by DeepSeek's names (``embed.weight``, ``layers.N.attn.wq_a.weight``,
``layers.N.ffn.experts.E.w1.weight``, ``hc_head_fn`` ...), with or without transformers'
``model.`` prefix and its spellings of the top-level ones (``model.embed_tokens.weight``,
``model.hc_head.hc_fn``, ``lm_head.weight``): ``model/v4/names.py``."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn

from tandem.model.expert_dispatch import ExpertDispatcher, LocalExperts
from tandem.model.kernels.backend import KernelBackend
from tandem.model.kernels.registry import get_backend
from tandem.model.v4.attention import LayerState, rms_norm
from tandem.model.v4.config import V4Config
from tandem.model.v4.hyper import HyperHead
from tandem.model.v4.layer import Step, V4Layer
from tandem.model.v4.mtp import V4MTP
from tandem.model.v4.names import parameter_for
from tandem.model.v4.rope import rope_table


class DeepseekV4(nn.Module):
    def __init__(
        self,
        cfg: V4Config,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        experts: range | None = None,
        dispatcher: ExpertDispatcher | None = None,
        ops: KernelBackend | None = None,
        mtp: bool = False,
    ) -> None:
        """``experts``: the routed experts this copy holds (all by default); a slice needs the
        expert-parallel ``dispatcher`` of its DEP group, which moves rows to their experts.
        ``ops``: the kernel backend (the device's by default). ``mtp``: with the MTP layer
        (``model/v4/mtp.py``)."""
        super().__init__()
        self.cfg, self.dtype, self.device = cfg, dtype, torch.device(device)
        self.experts = experts if experts is not None else range(cfg.n_routed_experts)
        if dispatcher is None and len(self.experts) != cfg.n_routed_experts:
            raise ValueError("a model holding a slice of the experts needs an expert-parallel dispatcher")
        self.dispatcher = dispatcher or LocalExperts()
        self.ops = ops or get_backend(self.device)
        v, h = cfg.vocab_size, cfg.hidden_size
        self.embed = nn.Parameter(torch.empty(v, h, dtype=dtype, device=device), requires_grad=False)
        self.layers = nn.ModuleList(
            V4Layer(cfg, i, dtype, device, self.experts) for i in range(cfg.num_hidden_layers)
        )
        self.norm = nn.Parameter(torch.empty(h, device=device), requires_grad=False)
        self.mtp = V4MTP(cfg, dtype, device, self.experts) if mtp else None
        self.hc_head = HyperHead(cfg.hc_mult, h, cfg.hc_eps, cfg.rms_norm_eps, device)
        self.head = nn.Parameter(torch.empty(v, h, dtype=dtype, device=device), requires_grad=False)
        self.rope: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for name, rope in (("main", cfg.rope_main), ("compress", cfg.rope_compress)):
            cos, sin = rope_table(rope, cfg.qk_rope_head_dim, cfg.max_position_embeddings)
            self.rope[name] = (cos.to(device), sin.to(device))

    @property
    def num_kv_layers(self) -> int:
        """Layers a transfer goes through, one by one: with the MTP layer, its state last."""
        return self.cfg.num_hidden_layers + int(self.mtp is not None)

    def weight_bytes(self) -> int:
        """Bytes of weights resident on this copy's device."""
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def owns_expert(self, layer: int, expert: int) -> bool:
        return expert in self.experts

    def new_state(self) -> list[LayerState]:
        """A request's state before its first token: one :class:`LayerState` per layer."""
        return [LayerState() for _ in self.layers]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        query_lens: list[int],
        states: list[list[LayerState]],
        before_head: bool = False,
        after_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Hidden states ``[T, D]`` after the final norm for the step's tokens, packed request
        after request (``query_lens`` each, at ``positions``, with ``states[r]`` the request's
        state, which moves on past these tokens). ``before_head``: the residual streams
        ``[T, hc_mult, D]`` before the hyper-head instead (what the MTP layer takes).
        ``after_layer(i)`` runs once layer ``i`` has run: the requests' states of that layer (and
        their entries in the pool) are final for this step from then on."""
        x = F.embedding(input_ids, self.embed)
        streams = x.unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        step = Step(input_ids, positions, query_lens, self.ops, self.dispatcher)
        for layer in self.layers:
            assert isinstance(layer, V4Layer)
            rope = self.rope["main" if layer.attn.rate == 0 else "compress"]
            streams = layer(streams, step, [s[layer.index] for s in states], rope)
            if after_layer is not None:
                after_layer(layer.index)
        return streams if before_head else self.head_hidden(streams)

    def head_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """The hyper-head and the final norm: streams -> hidden states ``[T, D]``."""
        return rms_norm(self.hc_head(streams), self.norm, self.cfg.rms_norm_eps)

    @torch.inference_mode()
    def draft(
        self,
        streams: torch.Tensor,
        next_ids: torch.Tensor,
        positions: torch.Tensor,
        query_lens: list[int],
        states: list[LayerState],
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MTP layer (``model/v4/mtp.py``) over the main model's ``streams`` at ``positions``
        and the tokens after them: ``(hidden [T, D]`` for :meth:`compute_logits` (the token two
        ahead), the MTP block's streams``)``; ``states[r]``: request ``r``'s MTP state."""
        if self.mtp is None:
            raise ValueError("this model was built without its MTP layer")
        step = Step(next_ids, positions, query_lens, self.ops, self.dispatcher)
        return self.mtp(streams, step, self.embed, states, self.rope["main"])

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.head)

    @torch.inference_mode()
    def load_weights(self, tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors in by name, routed experts into their stacks (experts this
        copy does not hold are skipped); a tensor of no parameter or of the wrong shape is an
        error that names it."""
        own = dict(self.named_parameters())
        items = tensors.items() if isinstance(tensors, Mapping) else tensors
        inter = self.cfg.moe_intermediate_size
        for name, tensor in items:
            if self.mtp is None and name.startswith(("mtp.", "model.mtp.")):  # the MTP layer: not asked for
                continue
            target = parameter_for(name, self.cfg)
            if target is None:
                raise ValueError(f"tensor {name}: not a DeepSeek-V4 tensor")
            param_name, expert, rows = target
            if expert is not None and expert not in self.experts:
                continue
            param = own.get(param_name)
            if param is None:
                raise ValueError(f"tensor {name}: the model has no parameter {param_name}")
            dst: torch.Tensor = param if expert is None else param[expert - self.experts.start]
            split = dst.shape[0] // 2 if param_name.endswith("_scale") else inter  # gate rows, then up
            if rows == "gate":
                dst = dst[:split]
            elif rows == "up":
                dst = dst[split:]
            if dst.shape != tensor.shape:
                raise ValueError(f"tensor {name}: shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
            dst.copy_(tensor.to(dst.dtype))
        if self.cfg.tie_word_embeddings:
            self.head.copy_(self.embed)
