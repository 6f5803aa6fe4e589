"""The chained hashes that name a prompt's full pages in every process: a rank's prefix cache and
KV tiers, its KV events, and the frontend's router (which hashes a prompt the same way to find
the rank that holds its longest prefix). A page's hash chains its parent's, from a root that a
request's ``cache_salt`` seeds, so one salt's blocks never match another's."""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass

_ROOT_MARKER = b"\x00"
_CHILD_MARKER = b"\x01"
_SALT_MARKER = b"\x02"


def block_hash(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """64-bit hash of one page's tokens chained to its parent's; the same in every process."""
    hasher = hashlib.blake2b(digest_size=8)
    if parent_hash is None:
        hasher.update(_ROOT_MARKER)
    else:
        hasher.update(_CHILD_MARKER + parent_hash.to_bytes(8, "little"))
    packed = array("q", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()
    hasher.update(packed.tobytes())
    return int.from_bytes(hasher.digest(), "little")


def chain_root(cache_salt: str | None) -> int | None:
    """The parent of a prompt's first block: ``None`` without a salt (the hashes every unsalted
    deployment has always used), else a 64-bit hash of the salt, so that every block of the
    chain differs from another salt's."""
    if cache_salt is None:
        return None
    digest = hashlib.blake2b(_SALT_MARKER + cache_salt.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def prompt_chain(token_ids: Sequence[int], page_size: int, cache_salt: str | None = None) -> list[ChainBlock]:
    """The full pages of ``token_ids`` as chain links, from the salt's root (a trailing partial
    page has none). The one computation of a prompt's chain: every other walk starts where this
    one does."""
    chain: list[ChainBlock] = []
    parent = chain_root(cache_salt)
    for start in range(0, len(token_ids) - page_size + 1, page_size):
        tokens = tuple(token_ids[start : start + page_size])
        chain.append(ChainBlock(block_hash(parent, tokens), parent, tokens))
        parent = chain[-1].block
    return chain


def block_hashes(token_ids: Sequence[int], page_size: int, cache_salt: str | None = None) -> list[int]:
    """Chained hashes of the full pages of ``token_ids`` (``prompt_chain``'s blocks)."""
    return [link.block for link in prompt_chain(token_ids, page_size, cache_salt)]


@dataclass(frozen=True)
class ChainBlock:
    """One full page of a prompt, as a lookup walks it: its hash, its parent's, its tokens."""

    block: int
    parent: int | None
    tokens: tuple[int, ...]
