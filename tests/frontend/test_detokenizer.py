"""The frontend's detokenizer gives the model's incremental detokenizer's text, token for token,
with its pair cache shared by streams (and emptied when full)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tandem.frontend.detokenizer import PairCache, StreamDetokenizer
from tandem.model.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = ["hello world", "café naïve über 数据 — end", "é", "  spaced  out\n\nlines", "🙂 emoji 🙂🙂"]


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def _compare(tokenizer: Tokenizer, cache: PairCache, ids: list[int]) -> None:
    reference, ours = IncrementalDetokenizer(tokenizer), StreamDetokenizer(cache)
    for i, token in enumerate(ids):
        assert ours.add(token) == reference.add(token), f"token {i} of {ids}"
    assert ours.finish() == reference.finish()


def test_text_is_the_models_detokenizers_token_for_token(tokenizer: Tokenizer) -> None:
    cache = PairCache(tokenizer)
    for text in TEXTS:
        _compare(tokenizer, cache, tokenizer.encode(text))
    rng = random.Random(0)
    for _ in range(200):  # any ids: special tokens, stray continuation bytes, cut characters
        _compare(tokenizer, cache, [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randrange(1, 40))])


def test_a_small_cache_starts_again_and_stays_right(tokenizer: Tokenizer) -> None:
    cache = PairCache(tokenizer, max_pairs=3)
    for text in TEXTS * 2:
        _compare(tokenizer, cache, tokenizer.encode(text))
    assert len(cache.texts) <= 3
    with pytest.raises(ValueError, match="max_pairs"):
        PairCache(tokenizer, max_pairs=0)
