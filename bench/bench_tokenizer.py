"""The frontend benchmark's tokenizer: a byte-level BPE of :data:`BENCH_VOCAB_SIZE` ids trained
here, offline, on real text found on this machine, and a model directory around it that the
frontend reads (``config.json``, ``tokenizer.json``, ``tokenizer_config.json``; no weights, the
frontend loads none).

The text, read in this order until :data:`MAX_TRAIN_CHARS` characters::

    english   model/demo/corpus.txt: the King James Bible, installed with the package
    other     text in other languages: vim's tutor translations, GnuPG's help texts, CPython's
              CJK test texts (whichever this machine has)
    code      the Python standard library's .py sources, then the environment's site-packages

The directory is cached as ``bench-tokenizer-<digest>`` under ``$XDG_CACHE_HOME/tandem``
(``~/.cache/tandem``), the digest naming the recipe, the vocabulary size and every text trained
on: a machine trains once (11-20 s measured on two cores for 40 million characters), and a
change of any text trains afresh. It is written to a temporary directory and renamed into place,
so a reader never sees half of one.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sysconfig
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from tandem.model.tokenizer import byte_level_alphabet

BENCH_VOCAB_SIZE = 100_000  # ids, the two special tokens included
MAX_TRAIN_CHARS = 40_000_000  # 11-20 s of training on two cores; 33 million gave 116,692 ids
CONTEXT_TOKENS = 16_384  # the bench model's context: the longest prompt (4,096) and its output
RECIPE = "bench-tokenizer-v1"  # change it with anything that changes what is trained
OTHER_LANGUAGE_GLOBS = (
    "/usr/share/vim/vim*/tutor/tutor.*.utf-8",
    "/usr/share/gnupg/help.*.txt",
)
TRAIN_FILE = "train.json"  # what the directory was trained on, and how long it took


class TextKind(Enum):
    ENGLISH = "english"
    OTHER = "other"  # other languages: characters of two to four bytes
    CODE = "code"


@dataclass(frozen=True)
class Text:
    kind: TextKind
    path: str
    text: str


@dataclass(frozen=True)
class BenchModelDir:
    """A model directory with the bench tokenizer. ``train_s`` is the training's own time when
    the directory was built (by this call or an earlier one, ``cached``)."""

    path: Path
    vocab_size: int
    train_s: float
    trained_chars: int
    texts: int
    digest: str
    cached: bool


class BenchTokenizerError(RuntimeError):
    """The text found on this machine trains fewer ids than asked for."""

    def __init__(self, vocab_size: int, wanted: int, chars: int) -> None:
        super().__init__(
            f"the {chars:,} characters of text found train {vocab_size:,} ids, fewer than the "
            f"{wanted:,} asked for: install more text (Python's test suite, vim) or ask for fewer"
        )


def cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "tandem"


def demo_dir() -> Path:
    import tandem.model  # no torch: the package's __init__ is a docstring

    return Path(tandem.model.__file__).parent / "demo"


def read_texts(max_chars: int = MAX_TRAIN_CHARS) -> list[Text]:
    """The text to train on, in the order of the module's docstring, up to ``max_chars``
    characters (files that are not UTF-8 are skipped)."""
    texts: list[Text] = []
    total = 0
    for kind, path in _candidates():
        if total >= max_chars:
            break
        try:
            text = Path(path).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        if text.strip():
            texts.append(Text(kind, path, text[: max_chars - total]))
            total += len(texts[-1].text)
    return texts


def _candidates() -> Iterator[tuple[TextKind, str]]:
    yield TextKind.ENGLISH, str(demo_dir() / "corpus.txt")
    stdlib = sysconfig.get_paths()["stdlib"]
    for pattern in (*OTHER_LANGUAGE_GLOBS, os.path.join(stdlib, "test", "cjkencodings", "*-utf8.txt")):
        for path in sorted(glob.glob(pattern)):
            yield TextKind.OTHER, path
    for root in dict.fromkeys((stdlib, sysconfig.get_paths()["purelib"])):
        for path in _python_files(root):
            yield TextKind.CODE, path


def _python_files(root: str) -> Iterator[str]:
    for folder, subfolders, files in os.walk(root):
        # sorted, so that the same files give the same text; site-packages is a root of its own
        subfolders[:] = sorted(d for d in subfolders if d not in ("site-packages", "__pycache__"))
        for name in sorted(files):
            if name.endswith(".py"):
                yield os.path.join(folder, name)


def digest(texts: list[Text], vocab_size: int) -> str:
    hasher = hashlib.sha256(f"{RECIPE}/{vocab_size}".encode())
    for text in texts:
        hasher.update(f"\0{text.kind.value}\0{len(text.text)}\0".encode())
        hasher.update(text.text.encode("utf-8", "surrogatepass"))
    return hasher.hexdigest()[:16]


def bench_model_dir(texts: list[Text] | None = None, vocab_size: int = BENCH_VOCAB_SIZE) -> BenchModelDir:
    """The cached model directory for ``texts`` (default: :func:`read_texts`), built first if
    this machine has none yet."""
    texts = read_texts() if texts is None else texts
    key = digest(texts, vocab_size)
    root = cache_root()
    path = root / f"bench-tokenizer-{key}"
    cached = (path / TRAIN_FILE).is_file()
    if not cached:
        root.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=root))
        try:
            _build(staging, texts, vocab_size)
            staging.chmod(0o755)
            try:
                staging.rename(path)
            except OSError:  # another process built it meanwhile: the same files
                if not (path / TRAIN_FILE).is_file():
                    raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    facts = json.loads((path / TRAIN_FILE).read_text())
    return BenchModelDir(
        path, facts["vocab_size"], facts["train_s"], facts["trained_chars"], facts["texts"], key, cached
    )


def _build(out_dir: Path, texts: list[Text], vocab_size: int) -> None:
    demo = demo_dir()
    tok_config: dict[str, Any] = json.loads((demo / "tokenizer_config.json").read_text(encoding="utf-8"))
    bos, eos = tok_config["bos_token"], tok_config["eos_token"]
    start = time.monotonic()
    tokenizer = train(texts, vocab_size, (bos, eos))
    train_s = time.monotonic() - start
    trained = tokenizer.get_vocab_size(with_added_tokens=True)
    chars = sum(len(t.text) for t in texts)
    if trained < vocab_size:
        raise BenchTokenizerError(trained, vocab_size, chars)
    (out_dir / "tokenizer.json").write_text(tokenizer.to_str() + "\n", encoding="utf-8")
    tok_config["model_max_length"] = CONTEXT_TOKENS
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(tok_config, indent=2, ensure_ascii=False) + "\n", encoding="utf-8"
    )
    # the demo model's shape (what ModelConfig checks), with this vocabulary and a longer context
    config: dict[str, Any] = json.loads((demo / "config.json").read_text())
    config |= {
        "vocab_size": trained,
        "bos_token_id": tokenizer.token_to_id(bos),
        "eos_token_id": tokenizer.token_to_id(eos),
        "max_position_embeddings": CONTEXT_TOKENS,
    }
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    facts = {
        "recipe": RECIPE,
        "vocab_size": trained,
        "train_s": round(train_s, 2),
        "trained_chars": chars,
        "texts": len(texts),
        "by_kind": {k.value: sum(len(t.text) for t in texts if t.kind is k) for k in TextKind},
    }
    (out_dir / TRAIN_FILE).write_text(json.dumps(facts, indent=2) + "\n")
    for file in out_dir.iterdir():
        file.chmod(0o644)


def train(texts: list[Text], vocab_size: int, special: tuple[str, str]) -> Tokenizer:
    """Byte-level BPE as GPT-2's and DeepSeek's: BOS and EOS are ids 0 and 1, then the 256
    bytes, then the merges; every encoding starts with BOS."""
    bos, eos = special
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[bos, eos],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator((t.text for t in texts), trainer, length=len(texts))
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.token_to_id(bos))]
    )
    return tokenizer


def token_bytes(tokenizer: Tokenizer) -> list[bytes]:
    """Each id's bytes (special tokens: their text's), from the byte-level alphabet."""
    byte_of = {char: byte for byte, char in enumerate(byte_level_alphabet())}
    out = [b""] * tokenizer.get_vocab_size(with_added_tokens=True)
    for token, token_id in tokenizer.get_vocab(with_added_tokens=True).items():
        if all(c in byte_of for c in token):
            out[token_id] = bytes(byte_of[c] for c in token)
        else:
            out[token_id] = token.encode()
    return out
