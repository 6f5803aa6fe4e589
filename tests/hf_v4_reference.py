"""transformers' ``DeepseekV4ForCausalLM`` as the golden reference for Tandem's V4, on tiny
checkpoints Tandem writes (``model/v4/tiny.py``), with one correction: its lightning indexer's
top-k breaks exact ties by the lowest entry index, the rule Tandem keeps
(``model/v4/indexer.py``). Unpatched, transformers' own V4 gives a request different tokens
depending on how it is split into forward calls (``torch.topk`` picks among tied entries by the
shape of the score matrix): ``test_v4_golden.py`` shows both."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.model.v4.config import V4Config
from tandem.model.v4.model import DeepseekV4


def write_tiny_v4(out_dir: Path, seed: int = 0, **overrides: Any) -> tuple[V4Config, dict[str, torch.Tensor]]:
    """``tandem model make-tiny --arch deepseek_v4``'s checkpoint, its config and tensors."""
    make_tiny_checkpoint(out_dir, seed=seed, arch="deepseek_v4", **overrides)
    return V4Config.from_dir(out_dir), load_file(out_dir / "model.safetensors")


def tandem_v4(cfg: V4Config, tensors: dict[str, torch.Tensor]) -> DeepseekV4:
    model = DeepseekV4(cfg)
    model.load_weights(tensors)
    return model


def hf_v4(model_dir: Path) -> Any:
    from transformers import DeepseekV4ForCausalLM

    return DeepseekV4ForCausalLM.from_pretrained(model_dir).eval()


def _stable_topk(self: torch.Tensor, k: int, dim: int = -1, largest: bool = True, sorted: bool = True) -> Any:
    values, indices = torch.sort(self, dim=dim, descending=largest, stable=True)
    return torch.return_types.topk((values.narrow(dim, 0, k), indices.narrow(dim, 0, k)))


@contextlib.contextmanager
def lowest_index_ties() -> Iterator[None]:
    """transformers' indexer with ties broken by the lowest entry index: inside its forward,
    ``Tensor.topk`` (its one selection) is a stable descending sort."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf_module

    original = hf_module.DeepseekV4Indexer.forward

    def forward(self: Any, *args: Any, **kwargs: Any) -> Any:
        topk = torch.Tensor.topk
        torch.Tensor.topk = _stable_topk  # type: ignore[method-assign,assignment]
        try:
            return original(self, *args, **kwargs)
        finally:
            torch.Tensor.topk = topk  # type: ignore[method-assign]

    hf_module.DeepseekV4Indexer.forward = forward
    try:
        yield
    finally:
        hf_module.DeepseekV4Indexer.forward = original


@torch.no_grad()
def hf_greedy(model: Any, prompt: list[int], new_tokens: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), max_new_tokens=new_tokens, do_sample=False, eos_token_id=None
    )
    return [int(t) for t in out[0, len(prompt) :]]


@torch.no_grad()
def hf_step_logits(model: Any, ids: list[int], chunk: int) -> torch.Tensor:
    """transformers' logits for ``ids`` computed ``chunk`` tokens a forward call."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.config)
    tensor = torch.tensor([ids])
    out = [
        model(tensor[:, i : i + chunk], cache=cache, use_cache=True).logits[0]
        for i in range(0, len(ids), chunk)
    ]
    return torch.cat(out)


def tandem_logits(model: DeepseekV4, ids: list[int], chunk: int) -> torch.Tensor:
    """Tandem's logits for ``ids`` computed ``chunk`` tokens a forward call."""
    state = model.new_state()
    out = []
    for i in range(0, len(ids), chunk):
        part = torch.tensor(ids[i : i + chunk])
        out.append(model.compute_logits(model(part, torch.arange(i, i + len(part)), [len(part)], [state])))
    return torch.cat(out)


def tandem_greedy(
    model: DeepseekV4, prompt: list[int], new_tokens: int, chunk: int | None = None
) -> list[int]:
    """Greedy tokens: the prompt ``chunk`` tokens a call (all at once by default), then one a call."""
    state, chunk = model.new_state(), chunk or len(prompt)
    logits = None
    for i in range(0, len(prompt), chunk):
        part = torch.tensor(prompt[i : i + chunk])
        logits = model.compute_logits(model(part, torch.arange(i, i + len(part)), [len(part)], [state]))
    assert logits is not None
    out = [int(logits[-1].argmax())]
    while len(out) < new_tokens:
        position = len(prompt) + len(out) - 1
        hidden = model(torch.tensor(out[-1:]), torch.tensor([position]), [1], [state])
        out.append(int(model.compute_logits(hidden)[-1].argmax()))
    return out
