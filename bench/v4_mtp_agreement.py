"""A DeepSeek-V4 model's MTP layer on held-out text: how often its greedy guess of the token
after next equals the model's own greedy token there (teacher-forced: what a one-token greedy
draft's acceptance would be), and how often the text's token.

``python -m tandem.bench.v4_mtp_agreement model/demo_v4`` (the demo corpus's held-out part, the
fixed batches of ``model/train_demo.py``'s evaluation)."""

from __future__ import annotations

import argparse
import sys

import torch


def agreement(
    model_dir: str, batches: int = 4, seq_tokens: int = 256, batch: int = 8
) -> tuple[float, float, int]:
    """``(draft == the model's greedy token, draft == the text's token, positions)``."""
    from tandem.model.loader import load_model
    from tandem.model.train_demo import DEMO_CORPUS, TrainSettings, _batch, _verse_starts, corpus_split
    from tandem.model.v4.attention import LayerState
    from tandem.model.v4.model import DeepseekV4

    model = load_model(model_dir, torch.float32, "cpu", mtp=True)
    assert isinstance(model, DeepseekV4)
    settings = TrainSettings(seq_tokens=seq_tokens, batch=batch)
    _, held = corpus_split(DEMO_CORPUS)
    starts = _verse_starts(held, settings.seq_tokens)
    gen = torch.Generator().manual_seed(1234)
    agree = truth = total = 0
    for _ in range(batches):
        ids = _batch(held, starts, settings, gen)
        rows, n = ids.shape
        positions = torch.arange(n).repeat(rows)
        streams = model(ids.flatten(), positions, [n] * rows, [model.new_state() for _ in range(rows)], True)
        greedy = model.compute_logits(model.head_hidden(streams)).argmax(-1).view(rows, n)
        keep = positions < n - 1
        states = [LayerState() for _ in range(rows)]
        hidden, _ = model.draft(streams[keep], ids[:, 1:].flatten(), positions[keep], [n - 1] * rows, states)
        # the draft at p guesses token p + 2; the model's own greedy token there comes from p + 1
        draft = model.compute_logits(hidden).argmax(-1).view(rows, n - 1)[:, :-1]
        agree += int((draft == greedy[:, 1:-1]).sum())
        truth += int((draft == ids[:, 2:]).sum())
        total += draft.numel()
    return agree / total, truth / total, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("model", help="a DeepSeek-V4 directory with its MTP layer (mtp.0.*)")
    args = parser.parse_args(argv)
    agree, truth, total = agreement(args.model)
    print(f"greedy draft = the model's greedy token: {agree:.1%}; = the text's token: {truth:.1%}", end="")
    print(f" ({total} positions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
