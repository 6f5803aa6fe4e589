"""Text <-> token ids with the model's own ``tokenizer.json`` (Hugging Face ``tokenizers``)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from tandem.model.errors import ModelFileError

TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
CONFIG_FILE = "config.json"
_REPLACEMENT = "\ufffd"


class TokenizerError(ModelFileError):
    """The model directory's tokenizer files are missing, unreadable or inconsistent."""


class Tokenizer:
    """A model's tokenizer with its BOS/EOS ids resolved.

    BOS and EOS come from the token strings in ``tokenizer_config.json`` when it names them,
    otherwise from ``bos_token_id``/``eos_token_id`` in ``config.json`` (the first, if a list).
    """

    def __init__(self, backend: HFTokenizer, bos_token_id: int | None, eos_token_id: int | None) -> None:
        self._backend = backend
        self.bos_token_id = bos_token_id
        self.eos_token_id = eos_token_id

    @staticmethod
    def from_dir(model_dir: Path | str) -> Tokenizer:
        model_dir = Path(model_dir)
        path = model_dir / TOKENIZER_FILE
        if not path.is_file():
            raise TokenizerError(path, f"{TOKENIZER_FILE} not found; the model directory must include it")
        try:
            backend = HFTokenizer.from_file(str(path))
        except Exception as exc:  # the Rust library raises a bare Exception for any parse error
            raise TokenizerError(path, f"cannot load {TOKENIZER_FILE}: {exc}") from exc
        tok_config = _read_json(model_dir / TOKENIZER_CONFIG_FILE)
        model_config = _read_json(model_dir / CONFIG_FILE)
        bos = _resolve(backend, model_dir, tok_config.get("bos_token"), model_config.get("bos_token_id"))
        eos = _resolve(backend, model_dir, tok_config.get("eos_token"), model_config.get("eos_token_id"))
        return Tokenizer(backend, bos, eos)

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce, special tokens included."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` with the tokenizer's special tokens (e.g. a leading BOS)."""
        return list(self._backend.encode(text, add_special_tokens=True).ids)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def special_token_ids(self) -> frozenset[int]:
        """The ids of the added tokens marked special (BOS, EOS, ...)."""
        return frozenset(i for i, t in self._backend.get_added_tokens_decoder().items() if t.special)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for: a byte-level token's own (perhaps part of a UTF-8
        character), else its text (a special token's included)."""
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        byte_of = _byte_of_char()
        if all(c in byte_of for c in piece):
            return bytes(byte_of[c] for c in piece)
        return self.decode([token_id], skip_special_tokens=False).encode()


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas without splitting a UTF-8 character.

    A byte-level token may hold part of a multi-byte character; its text then ends in U+FFFD
    until the rest arrives, so the delta is held back until the tail decodes cleanly. Text is
    decoded from ``prefix_offset`` (a few tokens of context) so that decoders which treat the
    start of a string specially (leading-space stripping) see the same start each time::

        ids:  [ ... | prefix_offset ... read_offset | new ids ... ]
                      already emitted, kept as       not emitted yet
                      context for the decoder
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_id: int) -> str:
        """Feed one token id; returns the text it completes (possibly empty)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def finish(self) -> str:
        """Text still held back at the end of the stream (an incomplete character decodes as U+FFFD,
        as :meth:`Tokenizer.decode` would show it)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special_tokens)


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        raw = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise TokenizerError(path, f"cannot read {path.name}: {exc}") from exc
    if not isinstance(raw, dict):
        raise TokenizerError(path, f"{path.name} must hold a JSON object")
    return raw


def _resolve(backend: HFTokenizer, model_dir: Path, token: Any, fallback_id: Any) -> int | None:
    """Id of a special token given as a string or as ``{"content": ...}`` (AddedToken form)."""
    if isinstance(token, dict):
        token = token.get("content")
    if isinstance(token, str):
        token_id = backend.token_to_id(token)
        if token_id is None:
            raise TokenizerError(
                model_dir / TOKENIZER_CONFIG_FILE, f"special token {token!r} is not in {TOKENIZER_FILE}"
            )
        return token_id
    if isinstance(fallback_id, list):
        fallback_id = fallback_id[0] if fallback_id else None
    return None if fallback_id is None else int(fallback_id)


@functools.cache
def _byte_of_char() -> dict[str, int]:
    return {c: b for b, c in enumerate(byte_level_alphabet())}


def byte_level_alphabet() -> list[str]:
    """GPT-2's byte -> printable character map, indexed by byte (``tokenizers``' ByteLevel)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]
