"""Where ranks publish their transfer metadata and peers find it.

A rank publishes :class:`RankMetadata` once per incarnation; a peer fetches it on first contact and
again whenever a destination names another incarnation. In a cluster the store is Ray's GCS
key-value store; tests of the protocol logic may use the in-memory one.
"""

from __future__ import annotations

import pickle
from abc import ABC, abstractmethod

from tandem.kvtransfer.types import RankMetadata


class MetadataStore(ABC):
    @abstractmethod
    def publish(self, meta: RankMetadata) -> None: ...

    @abstractmethod
    def fetch(self, rank: str) -> RankMetadata | None: ...


class InMemoryMetadataStore(MetadataStore):
    def __init__(self) -> None:
        self._items: dict[str, RankMetadata] = {}

    def publish(self, meta: RankMetadata) -> None:
        self._items[meta.rank] = meta

    def fetch(self, rank: str) -> RankMetadata | None:
        return self._items.get(rank)


class RayMetadataStore(MetadataStore):
    """Ray's GCS key-value store (reachable from every process of the Ray cluster)."""

    NAMESPACE = "tandem-kv"

    def publish(self, meta: RankMetadata) -> None:
        from ray.experimental import internal_kv

        internal_kv._internal_kv_put(meta.rank, pickle.dumps(meta), overwrite=True, namespace=self.NAMESPACE)

    def fetch(self, rank: str) -> RankMetadata | None:
        from ray.experimental import internal_kv

        raw = internal_kv._internal_kv_get(rank, namespace=self.NAMESPACE)
        return None if raw is None else pickle.loads(raw)
