"""An in-process ``KVStore`` for unit tests of the tiers' logic (the real store, Mooncake, is
tested on loopback in tests/integration): a dict, with switches to fail or corrupt."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.kvtransfer.kv_store import KVStore, StoreError


class DictStore(KVStore):
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}
        self.down = False
        self.gets = 0

    def _check(self) -> None:
        if self.down:
            raise StoreError("store is down")

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._check()
        return [k in self.values for k in keys]

    def get(self, key: str) -> bytes | None:
        self._check()
        self.gets += 1
        return self.values.get(key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def put(self, key: str, value: bytes) -> None:
        self._check()
        self.values.setdefault(key, value)

    def close(self) -> None:
        pass
