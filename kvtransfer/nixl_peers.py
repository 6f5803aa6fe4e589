"""The peers a NIXL agent writes to: each rank's agent loaded and its pool's descriptor list
prepared on first contact, cached until the rank's published incarnation changes or it is
fenced. Called with the transport's lock held."""

from __future__ import annotations

import contextlib
from typing import Any

from tandem.kvtransfer.metadata import MetadataStore
from tandem.kvtransfer.nixl_records import Peer
from tandem.kvtransfer.regions import TransferLayout
from tandem.kvtransfer.types import KVTransferError, StalePeerError


class NixlPeers:
    def __init__(self, agent: Any, store: MetadataStore, layout: TransferLayout) -> None:
        self.agent, self._store, self._layout = agent, store, layout
        self._by_rank: dict[str, Peer] = {}

    def __len__(self) -> int:
        return len(self._by_rank)

    def __contains__(self, rank: object) -> bool:
        return rank in self._by_rank

    def get(self, rank: str, incarnation: int | None, request_id: str) -> Peer:
        """The peer at ``incarnation`` (any published one if ``None``), fetched on first contact
        and again when the cached incarnation is not the one asked for."""
        cached = self._by_rank.get(rank)
        if cached is not None and incarnation in (None, cached.meta.incarnation):
            return cached
        meta = self._store.fetch(rank)
        if meta is None or (incarnation is not None and meta.incarnation != incarnation):
            raise StalePeerError(request_id, rank, incarnation if incarnation is not None else -1,
                                 None if meta is None else meta.incarnation)  # fmt: skip
        problem = self._layout.compatible_with(meta.layout)
        if problem:
            raise KVTransferError(request_id, f"pool of {rank} cannot take this pool's pages: {problem}")
        try:
            if cached is not None:
                self.agent.remove_remote_agent(cached.meta.agent_name)
                del self._by_rank[rank]
            self.agent.add_remote_agent(meta.agent_metadata)
            dlist = self.agent.prep_xfer_dlist(meta.agent_name, meta.layout.descs(), meta.layout.mem_type)
        except Exception as exc:  # NIXL's own errors: the peer's agent cannot be reached
            raise KVTransferError(request_id, f"cannot reach {rank} ({type(exc).__name__}: {exc})") from exc
        self._by_rank[rank] = peer = Peer(meta, dlist)
        return peer

    def forget(self, rank: str) -> None:
        """Its connection closed; a new incarnation is fetched afresh."""
        peer = self._by_rank.pop(rank, None)
        if peer is not None:
            with contextlib.suppress(Exception):  # an agent NIXL already dropped
                self.agent.remove_remote_agent(peer.meta.agent_name)
