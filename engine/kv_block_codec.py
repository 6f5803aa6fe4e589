"""One KV block as the shared store holds it: a checked header, then the page's bytes.

::

    | magic b"TKVB1" | header length: 4 bytes, big-endian | header: JSON | payload |

    header = {model, layout: [layers, page_size, token_dim, dtype], hash, parent, tokens,
              payload_bytes, crc32}

A block read back is used only if every check holds: the magic, the model and layout this rank
expects, the hash the rank asked for, the chain (``block_hash(parent, tokens) == hash``, and the
parent is the previous block of the prompt), the payload's length and its CRC-32. Anything else
is ``BlockRejected`` with the reason: a miss, counted, never garbage KV. The payload is the
page's KV, layer-major, as the rank's pool lays it out. This module is torch-free.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from dataclasses import dataclass

from tandem.engine.prefix_cache import block_hash

MAGIC = b"TKVB1"
_LENGTH_BYTES = 4


class BlockRejected(ValueError):
    """A block read from the store failed a check; the message says which."""


@dataclass(frozen=True)
class BlockLayout:
    """What a page's bytes mean: the pool's layers, tokens a page, values a token and dtype."""

    num_layers: int
    page_size: int
    token_dim: int
    dtype: str

    def as_list(self) -> list[object]:
        return [self.num_layers, self.page_size, self.token_dim, self.dtype]


def store_key(model: str, layout: BlockLayout, block: int) -> str:
    """The store's key of one block: the model, the layout and the block's chained hash."""
    shape = f"{layout.num_layers}x{layout.page_size}x{layout.token_dim}-{layout.dtype}"
    return f"tandem/{model}/{shape}/{block:016x}"


def encode_block(
    model: str, layout: BlockLayout, block: int, parent: int | None, tokens: Sequence[int], payload: bytes
) -> bytes:
    header = {
        "model": model,
        "layout": layout.as_list(),
        "hash": block,
        "parent": parent,
        "tokens": list(tokens),
        "payload_bytes": len(payload),
        "crc32": zlib.crc32(payload),
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    return MAGIC + len(head).to_bytes(_LENGTH_BYTES, "big") + head + payload


def decode_block(
    raw: bytes, *, model: str, layout: BlockLayout, block: int, parent: int | None, payload_bytes: int
) -> bytes:
    """The payload of ``raw`` if it is ``block`` (child of ``parent``) of ``model`` in ``layout``
    with ``payload_bytes`` of KV; ``BlockRejected`` naming the failed check otherwise."""
    if not raw.startswith(MAGIC):
        raise BlockRejected("not a KV block (bad magic)")
    start = len(MAGIC) + _LENGTH_BYTES
    if len(raw) < start:
        raise BlockRejected("truncated header")
    head_len = int.from_bytes(raw[len(MAGIC) : start], "big")
    if len(raw) < start + head_len:
        raise BlockRejected("truncated header")
    try:
        header = json.loads(raw[start : start + head_len])
    except (ValueError, UnicodeDecodeError) as error:
        raise BlockRejected(f"unreadable header: {error}") from None
    if not isinstance(header, dict):
        raise BlockRejected("unreadable header: not an object")
    if header.get("model") != model:
        raise BlockRejected(f"model {header.get('model')!r}, expected {model!r}")
    if header.get("layout") != layout.as_list():
        raise BlockRejected(f"layout {header.get('layout')!r}, expected {layout.as_list()!r}")
    if header.get("hash") != block or header.get("parent") != parent:
        raise BlockRejected("block or parent hash differs from the one asked for")
    tokens = header.get("tokens")
    if (
        not isinstance(tokens, list)
        or len(tokens) != layout.page_size
        or not all(type(t) is int for t in tokens)
        or block_hash(parent, tokens) != block
    ):
        raise BlockRejected("its tokens do not hash to its block hash")
    payload = raw[start + head_len :]
    if header.get("payload_bytes") != payload_bytes or len(payload) != payload_bytes:
        raise BlockRejected(f"{len(payload)} payload bytes, expected {payload_bytes}")
    if zlib.crc32(payload) != header.get("crc32"):
        raise BlockRejected("payload checksum mismatch")
    return payload
