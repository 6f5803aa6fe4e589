"""The shared KV store interface: blocks by key, readable by every rank of every node.

A store is a cache, never the truth: every call may fail (the store is down, slow or full), and
a caller treats a failure as a miss and computes again. ``put`` of a key that exists is a no-op
that succeeds. Backends register by name in ``kvtransfer.stores``; values are bytes the caller
encodes and checks itself (``engine/kv_block_codec.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass


class StoreError(RuntimeError):
    """A store call failed: the store is unreachable, refused the call or gave a malformed answer."""


@dataclass(frozen=True)
class StoreConfig:
    """Where a rank's store client connects and what it lends: ``master`` (HOST:PORT of the
    store's master), ``metadata`` (its metadata server's URL), ``segment_bytes`` of this process's
    memory added to the store's pool, ``local_buffer_bytes`` for the client's transfers, and
    ``local_hostname``, the address this client is reached at by the other clients (its node's:
    the rank sets it) and the only one it listens on. An address other than loopback is reached
    from the network, and Mooncake's clients serve reads and writes of their process's memory to
    whoever connects: that takes ``trusted_network`` (the operator's word that only the
    deployment's hosts reach it)."""

    master: str
    metadata: str
    segment_bytes: int = 256 << 20
    local_buffer_bytes: int = 64 << 20
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    backend: str = "mooncake"
    trusted_network: bool = False


class KVStore(ABC):
    """A client of the shared store. Calls come from one thread at a time per method group: the
    rank's loop reads (``exists``, ``get``), a writer thread writes (``put``); a backend must
    allow the two at once."""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is in the store; ``StoreError`` if the store cannot say."""

    @abstractmethod
    def get(self, key: str) -> bytes | None:
        """The value, or ``None`` when the key is not there; ``StoreError`` when the call failed."""

    @abstractmethod
    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Each key's value in one call (``None`` where it is missing); ``StoreError`` when the
        call failed."""

    @abstractmethod
    def put(self, key: str, value: bytes) -> None:
        """Store ``value`` under ``key``; ``StoreError`` when it was not stored."""

    @abstractmethod
    def close(self) -> None:
        """Leave the store (what this client lent it is gone with it)."""
