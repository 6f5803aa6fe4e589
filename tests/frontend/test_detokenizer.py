"""The frontend's detokenizer gives the model's incremental detokenizer's text, token for token,
with its pair cache shared by streams (and emptied when full)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tandem.frontend.detokenizer import MAX_WINDOW, PairCache, StreamDetokenizer
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
    assert len(cache.texts) <= 3 and len(cache.windows) <= 3
    with pytest.raises(ValueError, match="max_pairs"):
        PairCache(tokenizer, max_pairs=0)


def test_a_second_stream_of_the_same_text_calls_no_tokenizer(tokenizer: Tokenizer) -> None:
    """Characters of several bytes are held back over windows of a few tokens; once one stream
    has seen a window, every other stream reads its text from the cache."""
    cache = PairCache(tokenizer)
    ids = tokenizer.encode("数据 café 🙂 — naïve 数据")
    first = StreamDetokenizer(cache)
    texts = [first.add(t) for t in ids]
    assert "" in texts and cache.windows  # something was held back, over a window that is kept

    def no_call(_ids: list[int]) -> str:
        raise AssertionError("the tokenizer was called for a pair or window already seen")

    cache.decode = no_call  # type: ignore[method-assign]
    second = StreamDetokenizer(cache)
    assert [second.add(t) for t in ids] == texts


def test_a_window_longer_than_the_limit_is_computed_but_not_kept(tokenizer: Tokenizer) -> None:
    cache = PairCache(tokenizer)
    window = tokenizer.encode("abcdefghijklmnopqrstuvwxyz")[: MAX_WINDOW + 1]
    assert len(window) == MAX_WINDOW + 1
    assert cache.window_text(window, 1) == tokenizer.decode(window)[len(tokenizer.decode(window[:1])) :]
    assert not cache.windows
    assert cache.window_text(window[:2], 1) is not None and len(cache.windows) == 1
