"""The demo model: the tiny DeepSeek-V3 trained as a character-level model of English text.

``tandem serve`` and ``tandem generate`` without ``--model`` serve the checkpoint in
``model/demo/``, which this module trains (``tandem model train-demo OUT_DIR``). Its shapes are
exactly those of ``make_tiny`` (``tiny_config_dict``: 3 layers, hidden 64, 16 routed experts of
which 4 per token, byte-level vocabulary of 258); only the weights differ, so every figure
measured on the random tiny model holds for it.

Training, with Hugging Face ``transformers.DeepseekV3ForCausalLM`` on the CPU:

- corpus: ``model/demo/corpus.txt``, Genesis and Exodus of the King James Bible (public domain),
  one verse a line; the last 5% of its bytes are held out.
- sequences: BOS, then ``seq_tokens`` bytes from the start of a random verse, so a prompt
  (which the tokenizer opens with BOS) reads as the start of a verse.
- AdamW (betas 0.9, 0.95; weight decay 0.1 on matrices), learning rate 3e-3 after 50 warm-up
  steps, cosine to a tenth; gradients clipped to norm 1.
- routing: the routers' ``e_score_correction_bias`` follows DeepSeek-V3's auxiliary-loss-free
  balancing (after each step, +rate for an expert below the mean load, -rate above it), as the
  real model keeps its experts busy.

Then its multi-token-prediction layer (``DemoMTP``, the form ``model/mtp.py`` runs): DeepSeek-V3's
MTP loss, the cross-entropy of the byte after next from the model's final hidden state and the
next byte, ``mtp_steps`` steps with the model frozen (DeepSeek trains the two together; a layer
added to a trained model, as here, leaves the model's weights and figures as they were). Its
embedding and head start as the model's. ``--mtp-only`` trains only this layer onto an existing
checkpoint.

The committed checkpoint: ``tandem model train-demo model/demo`` with the defaults below (seed 0,
1400 steps of 32 sequences of 256 bytes, about 34 passes over the training text): 603 s of
training on two cores shared with other work (10 min 43 s for the whole command). Held-out loss
1.36 bits per character, from 8.04 untrained; the training loss of the last steps was 1.05-1.10.
Greedy, ``tandem generate --prompt "And God said" --max-tokens 48`` continues
``, Let the LORD beared unto him, What is thy son,``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch

from tandem.model.config import ModelConfig, expected_tensor_shapes
from tandem.model.make_tiny import BOS_ID, tiny_config_dict, write_checkpoint, write_tokenizer

if TYPE_CHECKING:
    from transformers import DeepseekV3ForCausalLM

DEMO_DIR = Path(__file__).parent / "demo"
DEMO_CORPUS = DEMO_DIR / "corpus.txt"
HELD_OUT_FRACTION = 0.05


class TrainingDependencyMissing(ImportError):
    """``transformers`` is not installed; training needs it (serving the demo model does not)."""

    def __init__(self) -> None:
        super().__init__(
            "train-demo needs transformers (DeepseekV3ForCausalLM): install the test extra, "
            "pip install -e '.[test]', or pip install transformers==5.24.0"
        )


@dataclass(frozen=True)
class TrainSettings:
    """``steps`` of the model, then ``mtp_steps`` of its MTP layer on the trained model."""

    steps: int = 1400
    mtp_steps: int = 600
    mtp_lr: float = 3e-3
    seq_tokens: int = 256  # bytes after BOS in each sequence
    batch: int = 32
    lr: float = 3e-3
    min_lr_fraction: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    bias_update_rate: float = 1e-3  # of the routers' e_score_correction_bias per step
    seed: int = 0
    eval_batches: int = 8

    def __post_init__(self) -> None:
        for name in ("steps", "seq_tokens", "batch", "eval_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {getattr(self, name)}")
        if self.mtp_steps < 0:
            raise ValueError(f"mtp_steps: expected an integer >= 0, got {self.mtp_steps}")


@dataclass
class TrainResult:
    out_dir: Path
    losses_bits: list[float] = field(default_factory=list)  # training loss per step, bits per byte
    initial_eval_bits: float = 0.0  # held-out loss before training
    eval_bits: float = 0.0  # held-out loss after training
    wall_s: float = 0.0
    mtp_losses_bits: list[float] = field(default_factory=list)  # the MTP layer's, per step
    mtp_eval_bits: float = 0.0  # its held-out loss on the next-next byte
    mtp_wall_s: float = 0.0


def _transformers() -> Any:
    try:
        import transformers
    except ImportError as exc:
        raise TrainingDependencyMissing() from exc
    return transformers


def _verse_starts(data: torch.Tensor, seq_tokens: int) -> torch.Tensor:
    """Offsets of every line start with ``seq_tokens + 1`` bytes after it (the +1: the last
    target)."""
    starts = torch.cat([torch.zeros(1, dtype=torch.long), (data == ord("\n")).nonzero()[:, 0] + 1])
    starts = starts[starts + seq_tokens + 1 <= data.numel()]
    if starts.numel() == 0:
        raise ValueError(f"corpus: expected at least {seq_tokens + 1} bytes after a line start")
    return starts


def _batch(
    data: torch.Tensor, starts: torch.Tensor, settings: TrainSettings, gen: torch.Generator
) -> torch.Tensor:
    """``[batch, 1 + seq_tokens]`` token ids: BOS, then the bytes from random line starts."""
    picks = starts[torch.randint(starts.numel(), (settings.batch,), generator=gen)]
    rows = data[picks[:, None] + torch.arange(settings.seq_tokens)]
    return torch.cat([torch.full((settings.batch, 1), BOS_ID, dtype=torch.long), rows], dim=1)


def _lr_at(step: int, settings: TrainSettings) -> float:
    if step < settings.warmup_steps:
        return settings.lr * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
    floor = settings.min_lr_fraction
    return settings.lr * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


class _ExpertBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: count each router's picks during a step, then
    move its ``e_score_correction_bias`` by ``rate`` towards the mean load."""

    def __init__(self, model: torch.nn.Module, rate: float) -> None:
        self.rate = rate
        routers = [
            m
            for m in model.modules()
            if isinstance(getattr(m, "e_score_correction_bias", None), torch.Tensor)
        ]
        self.biases = [cast(torch.Tensor, r.e_score_correction_bias) for r in routers]
        self.loads = [torch.zeros_like(bias) for bias in self.biases]
        for router, load in zip(routers, self.loads, strict=True):
            router.register_forward_hook(self._counter(load))

    @staticmethod
    def _counter(load: torch.Tensor) -> Callable[..., None]:
        def count(_module: torch.nn.Module, _inputs: Any, output: tuple[torch.Tensor, ...]) -> None:
            topk_indices = output[2]
            load.add_(torch.bincount(topk_indices.flatten(), minlength=load.numel()).to(load.dtype))

        return count

    @torch.no_grad()
    def update(self) -> None:
        for bias, load in zip(self.biases, self.loads, strict=True):
            bias.add_(self.rate * torch.sign(load.mean() - load))
            load.zero_()


def checkpoint_tensors(hf_model: torch.nn.Module, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """The model's weights under the checkpoint's names: Hugging Face keeps each layer's experts
    fused (``gate_up_proj`` ``[E, 2I, H]``, gate rows then up rows; ``down_proj`` ``[E, H, I]``),
    the checkpoint one tensor per expert and projection."""
    tensors: dict[str, torch.Tensor] = {}
    for name, tensor in hf_model.state_dict().items():
        tensor = tensor.detach().to(torch.float32)
        if name.endswith("mlp.experts.gate_up_proj"):
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                tensors[name.replace("gate_up_proj", f"{e}.gate_proj.weight")] = tensor[e, :inter].clone()
                tensors[name.replace("gate_up_proj", f"{e}.up_proj.weight")] = tensor[e, inter:].clone()
        elif name.endswith("mlp.experts.down_proj"):
            for e in range(tensor.shape[0]):
                tensors[name.replace("down_proj", f"{e}.down_proj.weight")] = tensor[e].clone()
        else:
            tensors[name] = tensor.clone()
    expected = expected_tensor_shapes(cfg)
    if sorted(tensors) != sorted(expected):
        raise ValueError(f"model tensors: expected {sorted(expected)}, got {sorted(tensors)}")
    for name, shape in expected.items():
        if tuple(tensors[name].shape) != tuple(shape):
            raise ValueError(f"{name}: expected shape {tuple(shape)}, got {tuple(tensors[name].shape)}")
    return tensors


def tiny_hf_model(seed: int) -> DeepseekV3ForCausalLM:
    """A freshly initialised ``DeepseekV3ForCausalLM`` with the tiny config (Hugging Face's
    initialisation, std 0.02, from ``seed``)."""
    transformers = _transformers()
    raw = tiny_config_dict()
    config = transformers.DeepseekV3Config(
        **{k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
    )
    torch.manual_seed(seed)
    model: DeepseekV3ForCausalLM = transformers.DeepseekV3ForCausalLM(config)
    return model


def corpus_split(corpus: Path | str) -> tuple[torch.Tensor, torch.Tensor]:
    """The corpus's bytes as token ids: the training part, then the held-out last 5%."""
    data = torch.frombuffer(bytearray(Path(corpus).read_bytes()), dtype=torch.uint8).long()
    split = int(data.numel() * (1 - HELD_OUT_FRACTION))
    return data[:split], data[split:]


@torch.no_grad()
def held_out_bits(model: torch.nn.Module, data: torch.Tensor, settings: TrainSettings) -> float:
    """Mean next-byte loss in bits over fixed batches of ``data`` (the same batches every call)."""
    model.eval()
    starts = _verse_starts(data, settings.seq_tokens)
    gen = torch.Generator().manual_seed(1234)
    total = 0.0
    for _ in range(settings.eval_batches):
        ids = _batch(data, starts, settings, gen)
        total += float(model(input_ids=ids, labels=ids).loss)
    model.train()
    return total / settings.eval_batches / math.log(2)


def train_model(
    model: torch.nn.Module,
    corpus: Path | str,
    settings: TrainSettings,
    out_dir: Path,
    log: Callable[[str], None] | None = None,
) -> tuple[TrainResult, torch.Tensor, torch.Tensor]:
    """Train a freshly initialised transformers model on ``corpus`` (the batches, optimizer,
    schedule, clip and expert balancing above); its result and the corpus's two parts."""
    corpus = Path(corpus)
    if not corpus.is_file():
        raise FileNotFoundError(f"--corpus: {corpus} is not a file")
    train_data, held_out = corpus_split(corpus)
    starts = _verse_starts(train_data, settings.seq_tokens)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=settings.lr,
        betas=(0.9, 0.95),
    )
    result = TrainResult(out_dir, initial_eval_bits=held_out_bits(model, held_out, settings))
    balancer = _ExpertBalancer(model, settings.bias_update_rate)
    gen = torch.Generator().manual_seed(settings.seed)
    began = time.monotonic()
    model.train()
    for step in range(settings.steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, settings)
        ids = _batch(train_data, starts, settings, gen)
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), settings.grad_clip)
        optimizer.step()
        balancer.update()
        result.losses_bits.append(float(loss.detach()) / math.log(2))
        if log is not None and (step % 50 == 0 or step == settings.steps - 1):
            log(f"step {step}: loss {result.losses_bits[-1]:.3f} bits/byte, {time.monotonic() - began:.0f} s")
    result.wall_s = time.monotonic() - began
    result.eval_bits = held_out_bits(model, held_out, settings)
    return result, train_data, held_out


def train_demo(
    out_dir: Path | str,
    corpus: Path | str = DEMO_CORPUS,
    settings: TrainSettings | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train the tiny model on ``corpus`` and write its checkpoint to ``out_dir``: ``config.json``
    and ``model.safetensors`` (float32) by ``make_tiny``'s ``write_checkpoint``, the tokenizer files
    by its ``write_tokenizer``. Files of those names in ``out_dir`` are replaced; others are left."""
    settings = settings or TrainSettings()
    model = tiny_hf_model(settings.seed)
    result, train_data, held_out = train_model(model, corpus, settings, Path(out_dir), log)
    return _write(model, train_data, held_out, settings, result, log)


def train_demo_mtp(
    model_dir: Path | str,
    corpus: Path | str = DEMO_CORPUS,
    settings: TrainSettings | None = None,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train only the MTP layer of the demo checkpoint in ``model_dir`` (its model's weights are
    kept bit for bit) and write the checkpoint back with it: the second half of ``train_demo``."""
    settings = settings or TrainSettings()
    model = _transformers().DeepseekV3ForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    train_data, held_out = corpus_split(corpus)
    result = TrainResult(Path(model_dir), eval_bits=held_out_bits(model, held_out, settings))
    result.initial_eval_bits = result.eval_bits
    return _write(model, train_data, held_out, settings, result, log)


def _write(
    model: DeepseekV3ForCausalLM,
    train_data: torch.Tensor,
    held_out: torch.Tensor,
    settings: TrainSettings,
    result: TrainResult,
    log: Callable[[str], None] | None,
) -> TrainResult:
    raw = tiny_config_dict()
    tensors = checkpoint_tensors(model, ModelConfig.from_dict(raw))
    if settings.mtp_steps:
        mtp = train_mtp(model, train_data, held_out, settings, result, log)
        raw = tiny_config_dict(num_nextn_predict_layers=1)
        tensors |= mtp.tensors(ModelConfig.from_dict(raw).num_hidden_layers)
    out = result.out_dir
    write_checkpoint(out, raw, tensors)
    write_tokenizer(out)
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        (out / name).chmod(0o644)  # safetensors writes its file private; a model directory is shared
    return result


# -- the multi-token-prediction layer -----------------------------------------------------------


class DemoMTP(torch.nn.Module):
    """DeepSeek-V3's MTP layer (depth 1) around the trained model, in the form
    ``model/mtp.py`` runs it: row ``i`` combines the byte at ``i + 1`` with the model's final
    hidden state at ``i`` and predicts the byte at ``i + 2``. Its decoder layer, final norm and
    head are a one-layer ``DeepseekV3ForCausalLM`` (``block``): its ``model.norm`` is the MTP
    layer's ``shared_head.norm``, its ``lm_head`` the ``shared_head.head``, its embedding the MTP
    layer's own ``embed_tokens`` (initialised from the model's, as is the head)."""

    def __init__(self, model: DeepseekV3ForCausalLM, seed: int) -> None:
        super().__init__()
        transformers = _transformers()
        raw = tiny_config_dict(num_hidden_layers=1, first_k_dense_replace=0)
        config = transformers.DeepseekV3Config(
            **{k: v for k, v in raw.items() if k not in ("architectures", "model_type")}
        )
        torch.manual_seed(seed + 1)
        self.block = transformers.DeepseekV3ForCausalLM(config)
        h = config.hidden_size
        with torch.no_grad():
            self.block.model.embed_tokens.weight.copy_(model.model.embed_tokens.weight)
            self.block.lm_head.weight.copy_(model.lm_head.weight)
        self.enorm = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RMSNorm(
            h, config.rms_norm_eps
        )
        self.hnorm = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3RMSNorm(
            h, config.rms_norm_eps
        )
        self.eh_proj = torch.nn.Linear(2 * h, h, bias=False)
        torch.nn.init.normal_(self.eh_proj.weight, std=config.initializer_range)

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The mean loss in nats of predicting ``ids[:, i + 2]`` from ``ids[:, i + 1]`` and
        ``hidden[:, i]`` (``ids [B, L]``, ``hidden [B, L, H]`` the model's, after its final norm)."""
        e = self.block.model.embed_tokens(ids[:, 1:])
        e = torch.cat([torch.zeros_like(e[:, :1]), e[:, 1:]], dim=1)  # row 0 sits at position 0
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(hidden[:, :-1])], dim=-1))
        return self.block(inputs_embeds=x, labels=ids[:, 1:]).loss  # labels shift once more: i + 2

    def tensors(self, layer: int) -> dict[str, torch.Tensor]:
        """Its weights under the checkpoint's names, as layer ``layer`` (``num_hidden_layers``)."""
        cfg = ModelConfig.from_dict(tiny_config_dict(num_hidden_layers=1, first_k_dense_replace=0))
        block = checkpoint_tensors(self.block, cfg)
        p = f"model.layers.{layer}."
        out = {
            p + k.removeprefix("model.layers.0."): v
            for k, v in block.items()
            if k.startswith("model.layers.0.")
        }
        out[p + "embed_tokens.weight"] = block["model.embed_tokens.weight"]
        out[p + "shared_head.norm.weight"] = block["model.norm.weight"]
        out[p + "shared_head.head.weight"] = block["lm_head.weight"]
        out[p + "enorm.weight"] = self.enorm.weight.detach().float().clone()
        out[p + "hnorm.weight"] = self.hnorm.weight.detach().float().clone()
        out[p + "eh_proj.weight"] = self.eh_proj.weight.detach().float().clone()
        return out


@torch.no_grad()
def _final_hidden(model: DeepseekV3ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    return model.model(input_ids=ids).last_hidden_state


@torch.no_grad()
def mtp_held_out_bits(
    mtp: torch.nn.Module,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    data: torch.Tensor,
    settings: TrainSettings,
) -> float:
    """An MTP layer's mean next-next-byte loss in bits (``loss_of(ids)``, nats) over the fixed
    held-out batches."""
    mtp.eval()
    starts = _verse_starts(data, settings.seq_tokens)
    gen = torch.Generator().manual_seed(1234)
    total = 0.0
    for _ in range(settings.eval_batches):
        total += float(loss_of(_batch(data, starts, settings, gen)))
    mtp.train()
    return total / settings.eval_batches / math.log(2)


def train_mtp(
    model: DeepseekV3ForCausalLM,
    train_data: torch.Tensor,
    held_out: torch.Tensor,
    settings: TrainSettings,
    result: TrainResult,
    log: Callable[[str], None] | None = None,
) -> DemoMTP:
    """Train the MTP layer on the trained model, which stays frozen: DeepSeek-V3's MTP loss (the
    next-next token's cross-entropy), the same schedule shape as the model's."""
    mtp = DemoMTP(model, settings.seed)
    model.eval()
    fit_mtp(mtp, lambda ids: mtp(ids, _final_hidden(model, ids)), train_data, held_out, settings, result, log)
    return mtp


def fit_mtp(
    mtp: torch.nn.Module,
    loss_of: Callable[[torch.Tensor], torch.Tensor],
    train_data: torch.Tensor,
    held_out: torch.Tensor,
    settings: TrainSettings,
    result: TrainResult,
    log: Callable[[str], None] | None = None,
) -> None:
    """``settings.mtp_steps`` AdamW steps of ``mtp``'s trainable parameters on ``loss_of(ids)``
    (nats) over training batches, its routers balanced as the model's are; the losses and the
    held-out loss into ``result``."""
    starts = _verse_starts(train_data, settings.seq_tokens)
    params = [p for p in mtp.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(
        [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": settings.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ],
        lr=settings.mtp_lr,
        betas=(0.9, 0.95),
    )
    balancer = _ExpertBalancer(mtp, settings.bias_update_rate)
    gen = torch.Generator().manual_seed(settings.seed + 1)
    schedule = TrainSettings(
        steps=max(1, settings.mtp_steps), lr=settings.mtp_lr, warmup_steps=settings.warmup_steps
    )
    began = time.monotonic()
    mtp.train()
    for step in range(settings.mtp_steps):
        for group in optimizer.param_groups:
            group["lr"] = _lr_at(step, schedule)
        loss = loss_of(_batch(train_data, starts, settings, gen))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, settings.grad_clip)
        optimizer.step()
        balancer.update()
        result.mtp_losses_bits.append(float(loss.detach()) / math.log(2))
        if log is not None and (step % 50 == 0 or step == settings.mtp_steps - 1):
            elapsed = time.monotonic() - began
            log(f"mtp step {step}: loss {result.mtp_losses_bits[-1]:.3f} bits/byte, {elapsed:.0f} s")
    result.mtp_wall_s = time.monotonic() - began
    result.mtp_eval_bits = mtp_held_out_bits(mtp, loss_of, held_out, settings)
