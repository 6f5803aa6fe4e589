"""The shared KV store on Mooncake Store (``mooncake-transfer-engine``; its non-CUDA build on
CPU machines): a master (``mooncake_master``, with its HTTP metadata server) and a client in
every rank that lends the store a memory segment. Blocks are plain values under string keys.

Return codes: ``put``/``is_exist`` answer a negative code when the call failed (e.g. -600 when
the master is unreachable); ``get`` answers empty bytes for a missing key or a failed call, so
an empty answer after an ``is_exist`` of 1 is a failure.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tandem.kvtransfer.kv_store import KVStore, StoreConfig, StoreError


class MooncakeStore(KVStore):
    def __init__(self, config: StoreConfig) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as error:  # the package, or a library it loads (libibverbs)
            raise StoreError(f"the Mooncake store client cannot be loaded: {error}") from error
        self.config = config
        self._store: Any = MooncakeDistributedStore()
        code = self._store.setup(
            config.local_hostname,
            config.metadata,
            config.segment_bytes,
            config.local_buffer_bytes,
            config.protocol,
            "",
            config.master,
        )
        if code != 0:
            raise StoreError(f"Mooncake store setup against master {config.master} failed (code {code})")
        self._failed = False

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes = self._store.batch_is_exist(list(keys))
        if len(codes) != len(keys) or any(c < 0 for c in codes):
            self._failed = True
            raise StoreError(f"is_exist failed (codes {sorted(set(codes))})")
        return [c == 1 for c in codes]

    def get(self, key: str) -> bytes | None:
        value = self._store.get(key)
        if value:
            return bytes(value)
        code = self._store.is_exist(key)
        if code < 0:
            self._failed = True
            raise StoreError(f"get of {key} failed (code {code})")
        if code == 1:
            raise StoreError(f"get of {key} came back empty though the key exists")
        return None

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """One batched read; an empty answer is a miss (a key evicted since, or a failed read:
        the caller stops its run there either way)."""
        if not keys:
            return []
        values = self._store.get_batch(list(keys))
        if len(values) != len(keys):
            self._failed = True
            raise StoreError(f"get_batch answered {len(values)} values for {len(keys)} keys")
        return [bytes(v) if v else None for v in values]

    def put(self, key: str, value: bytes) -> None:
        code = self._store.put(key, value)
        self._failed = code != 0
        if code != 0:
            raise StoreError(f"put of {key} ({len(value)} bytes) failed (code {code})")

    def close(self) -> None:
        """Leave the store. With its master unreachable the client's close retries for about
        ten seconds holding the interpreter; it is waited for all the same, since a client
        left to be destroyed during the interpreter's finalization crashes the process."""
        self._store.close()
