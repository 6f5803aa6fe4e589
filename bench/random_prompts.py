"""Prompts of random token ids for the benchmarks: none shares a prefix with another, so no
prefix cache helps and every prompt token is computed."""

from __future__ import annotations

import random
from pathlib import Path

from tandem.model.config import ModelConfig


class RandomPrompts:
    def __init__(self, model_dir: Path, seed: int = 0) -> None:
        self.vocab_size = ModelConfig.from_dir(model_dir).vocab_size
        self.rng = random.Random(seed)

    def make(self, count: int, tokens: int) -> list[list[int]]:
        return [[self.rng.randrange(self.vocab_size) for _ in range(tokens)] for _ in range(count)]
