from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from tokenizers import pre_tokenizers
from transformers import AutoTokenizer

from tandem.model.make_tiny import BOS_ID, EOS_ID
from tandem.model.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError, byte_level_alphabet

TEXTS = ["Hello, world!", "héllo 世界 🙂", "  leading spaces\nand a newline\t", "ß∂ƒ©˙∆˚¬ 🙂🙂 Ελληνικά"]


@pytest.fixture(scope="module")
def tok(tiny_dir: Path) -> Tokenizer:
    return Tokenizer.from_dir(tiny_dir)


def test_vocabulary_is_bytes_then_special_tokens(tok: Tokenizer) -> None:
    assert sorted(byte_level_alphabet()) == sorted(pre_tokenizers.ByteLevel.alphabet())
    assert tok.vocab_size == 258
    assert (tok.bos_token_id, tok.eos_token_id) == (BOS_ID, EOS_ID) == (256, 257)


def test_encode_adds_bos_and_maps_bytes(tok: Tokenizer) -> None:
    text = "héllo 🙂"
    assert tok.encode(text) == [BOS_ID, *text.encode("utf-8")]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok: Tokenizer, text: str) -> None:
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert (
        tok.decode([*ids, EOS_ID], skip_special_tokens=False)
        == f"<｜begin▁of▁sentence｜>{text}<｜end▁of▁sentence｜>"
    )


def test_transformers_reads_the_same_tokenizer(tiny_dir: Path, tok: Tokenizer) -> None:
    hf = AutoTokenizer.from_pretrained(tiny_dir)
    assert (hf.bos_token_id, hf.eos_token_id) == (BOS_ID, EOS_ID)
    for text in TEXTS:
        assert hf(text)["input_ids"] == tok.encode(text)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_detokenizer_matches_decode(tok: Tokenizer, text: str) -> None:
    ids = [*tok.encode(text), EOS_ID]
    detok = IncrementalDetokenizer(tok)
    deltas = [detok.add(i) for i in ids]
    deltas.append(detok.finish())
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    if text == "héllo 世界 🙂":  # each multi-byte character arrives whole, with its last byte
        emitted = [d for d in deltas if d]
        assert emitted == list(text)


def test_incremental_detokenizer_flushes_a_cut_character(tok: Tokenizer) -> None:
    ids = tok.encode("ok 🙂")[:-2]  # the emoji's last two bytes never arrive
    detok = IncrementalDetokenizer(tok)
    streamed = "".join(detok.add(i) for i in ids)
    assert streamed == "ok "
    assert streamed + detok.finish() == tok.decode(ids)


def test_special_ids_fall_back_to_config(tmp_path: Path, tiny_dir: Path) -> None:
    shutil.copy(tiny_dir / "tokenizer.json", tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": 5, "eos_token_id": [7, 257]}))
    tok = Tokenizer.from_dir(tmp_path)
    assert (tok.bos_token_id, tok.eos_token_id) == (5, 7)

    eos = {"__type": "AddedToken", "content": "<｜end▁of▁sentence｜>"}  # the Hub's object form
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": eos}))
    assert Tokenizer.from_dir(tmp_path).eos_token_id == EOS_ID

    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>"}))
    with pytest.raises(TokenizerError, match=r"'<s>' is not in tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)


def test_missing_or_broken_tokenizer_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError) as info:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer.json") in str(info.value)
    (tmp_path / "tokenizer.json").write_text("{broken")
    with pytest.raises(TokenizerError, match=r"cannot load tokenizer\.json"):
        Tokenizer.from_dir(tmp_path)
