"""The shared KV store backends by name."""

from __future__ import annotations

from collections.abc import Callable

from tandem.kvtransfer.kv_store import KVStore, StoreConfig, StoreError
from tandem.kvtransfer.mooncake_store import MooncakeStore

STORES: dict[str, Callable[[StoreConfig], KVStore]] = {"mooncake": MooncakeStore}


def open_store(config: StoreConfig) -> KVStore:
    """A client of the store ``config`` names; ``StoreError`` when it cannot connect."""
    factory = STORES.get(config.backend)
    if factory is None:
        raise StoreError(f"unknown store backend {config.backend!r}; known: {sorted(STORES)}")
    return factory(config)
