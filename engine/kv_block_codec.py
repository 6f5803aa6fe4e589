"""One KV block as the shared store holds it: an authenticated header, the page's bytes, a tag.

::

    key   = tandem/{model}/{layers}x{page_size}x{dim}-{dtype}/{HMAC(secret, model, layout, hash)}
    value = | magic b"TKVB2" | header length: 4 bytes, big-endian | header: JSON | payload | tag |

    header = {model, layout: [layers, page_size, token_dim, dtype], tokens, payload_bytes}
    tokens = HMAC-SHA256(secret, parent hash, token ids)   (hex: the ids themselves are not kept)
    tag    = HMAC-SHA256(secret, key, magic .. payload)    (32 bytes)

``secret`` is the deployment's (``store_secret``: the controller makes it, or the topology names
it, and every rank of the deployment holds it; a deployment that shares a store with another names
the same one). Without it nobody can write a block a rank accepts, tell which prompt a block
holds, or find a guessed prompt's key.

A block read back is used only if every check holds, in this order: the magic, the tag (before
anything of the header is parsed), the model and layout this rank expects, the tokens: the
digest of the request's own tokens (and their parent) equals the block's, the payload's length
(a DeepSeek-V4 page's, one of two: its entries alone, or with its boundary state too).
Anything else is ``BlockRejected`` with the reason: a miss, counted, never garbage KV. The
payload is the page's KV, layer-major, as the rank's pool lays it out. This module is torch-free.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

MAGIC = b"TKVB2"
_LENGTH_BYTES = 4
_TAG_BYTES = 32


class BlockRejected(ValueError):
    """A block read from the store failed a check; the message says which."""


@dataclass(frozen=True)
class BlockLayout:
    """What a page's bytes mean: the pool's layers, tokens a page, values a token and dtype; a
    pool of several kinds of state (DeepSeek-V4) names them in ``kinds`` (each kind's name,
    layers, rows and numbers a row, and dtype, in payload order), its ``token_dim`` 0."""

    num_layers: int
    page_size: int
    token_dim: int
    dtype: str
    kinds: str = ""

    def as_list(self) -> list[object]:
        head: list[object] = [self.num_layers, self.page_size, self.token_dim, self.dtype]
        return [*head, self.kinds] if self.kinds else head

    @property
    def shape(self) -> str:
        shape = f"{self.num_layers}x{self.page_size}x{self.token_dim}-{self.dtype}"
        if self.kinds:  # the kinds' digest: a key names the layout whole, and stays short
            shape += "-" + hashlib.sha256(self.kinds.encode()).hexdigest()[:12]
        return shape


def _mac(secret: bytes, *parts: bytes) -> bytes:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:
        mac.update(len(part).to_bytes(8, "big") + part)  # framed: no two part lists collide
    return mac.digest()


def _hash_bytes(block: int | None) -> bytes:
    return b"" if block is None else block.to_bytes(8, "little")


def tokens_digest(secret: bytes, parent: int | None, tokens: Sequence[int]) -> str:
    """What a block keeps of its tokens: a keyed digest, comparable only by a holder of ``secret``."""
    packed = array("q", tokens)
    if sys.byteorder == "big":
        packed.byteswap()
    return _mac(secret, b"tokens", _hash_bytes(parent), packed.tobytes()).hex()


def store_key(secret: bytes, model: str, layout: BlockLayout, block: int) -> str:
    """The store's key of one block: the model and layout (readable), and the block's chained hash
    under the secret (a guessed prompt's hash does not give its key)."""
    name = _mac(secret, b"key", model.encode(), layout.shape.encode(), _hash_bytes(block))
    return f"tandem/{model}/{layout.shape}/{name[:16].hex()}"


@dataclass(frozen=True)
class StoredBlock:
    """A block as the store holds it: its ``key``, and the page of ``tokens`` (child of
    ``parent``) whose KV it is."""

    key: str
    parent: int | None
    tokens: Sequence[int]


def encode_block(secret: bytes, block: StoredBlock, model: str, layout: BlockLayout, payload: bytes) -> bytes:
    """The value stored under ``block.key`` for its page of tokens."""
    key, parent, tokens = block.key, block.parent, block.tokens
    header = {
        "model": model,
        "layout": layout.as_list(),
        "tokens": tokens_digest(secret, parent, tokens),
        "payload_bytes": len(payload),
    }
    head = json.dumps(header, separators=(",", ":")).encode()
    body = MAGIC + len(head).to_bytes(_LENGTH_BYTES, "big") + head + payload
    return body + _mac(secret, b"block", key.encode(), body)


def decode_block(
    raw: bytes,
    *,
    secret: bytes,
    block: StoredBlock,
    model: str,
    layout: BlockLayout,
    payload_bytes: int | tuple[int, ...],
) -> bytes:
    """The payload of ``raw``, read under ``block.key``, if it holds the block's tokens (child of
    its parent) of ``model`` in ``layout`` with ``payload_bytes`` of KV (or any of several
    lengths: a V4 page's, with or without its boundary state), written by a holder of
    ``secret``; ``BlockRejected`` naming the failed check otherwise."""
    sizes = (payload_bytes,) if isinstance(payload_bytes, int) else payload_bytes
    key, parent, tokens = block.key, block.parent, block.tokens
    if not raw.startswith(MAGIC):
        raise BlockRejected("not a KV block of this format (bad magic)")
    start = len(MAGIC) + _LENGTH_BYTES
    if len(raw) < start + _TAG_BYTES:
        raise BlockRejected("truncated block")
    body, tag = raw[:-_TAG_BYTES], raw[-_TAG_BYTES:]
    if not hmac.compare_digest(tag, _mac(secret, b"block", key.encode(), body)):
        raise BlockRejected("bad tag: forged, corrupt, or written under another deployment's secret")
    head_len = int.from_bytes(raw[len(MAGIC) : start], "big")
    if len(body) < start + head_len:
        raise BlockRejected("truncated header")
    try:
        header = json.loads(body[start : start + head_len])
    except (ValueError, UnicodeDecodeError) as error:
        raise BlockRejected(f"unreadable header: {error}") from None
    if not isinstance(header, dict):
        raise BlockRejected("unreadable header: not an object")
    if header.get("model") != model:
        raise BlockRejected(f"model {header.get('model')!r}, expected {model!r}")
    if header.get("layout") != layout.as_list():
        raise BlockRejected(f"layout {header.get('layout')!r}, expected {layout.as_list()!r}")
    digest = header.get("tokens")
    if not isinstance(digest, str) or not hmac.compare_digest(digest, tokens_digest(secret, parent, tokens)):
        raise BlockRejected("its tokens (or their parent) differ from the request's")
    payload = body[start + head_len :]
    if header.get("payload_bytes") != len(payload) or len(payload) not in sizes:
        expected = " or ".join(str(size) for size in sizes)
        raise BlockRejected(f"{len(payload)} payload bytes, expected {expected}")
    return payload
