"""A Ray actor that owns a KV pool, a page allocator and a KV transport: one side of a transfer,
for the transfer benchmark and the transfer integration tests. Its owner frees pages only when the
transport reports a request over, as the prefill and decode ranks do."""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import ray
import torch

from tandem.engine.page_allocator import PageAllocator
from tandem.kvtransfer.metadata import RayMetadataStore
from tandem.kvtransfer.registry import transport_class
from tandem.kvtransfer.transport import TransferFailure, TransportEvents
from tandem.kvtransfer.types import KVDestination, KVNotification, TransferStats
from tandem.model.kv_pool import pool_layout


@dataclass
class PeerEvents:
    received: dict[str, KVNotification] = field(default_factory=dict)
    received_stats: dict[str, TransferStats] = field(default_factory=dict)
    sent: dict[str, TransferStats] = field(default_factory=dict)
    failed: dict[str, TransferFailure] = field(default_factory=dict)


@ray.remote
class KVPeer:
    def __init__(
        self,
        rank: str,
        incarnation: int,
        num_layers: int,
        num_pages: int,
        page_size: int,
        token_dim: int,
        dtype: str = "float32",
        transport: str = "nixl",
    ) -> None:
        torch.set_num_threads(1)
        self.pool = torch.zeros((num_layers, num_pages, page_size, token_dim), dtype=getattr(torch, dtype))
        self.allocator = PageAllocator(num_pages)
        self.transport = transport_class(transport)(
            rank, incarnation, pool_layout(self.pool), RayMetadataStore()
        )
        self._held: dict[str, list[int]] = {}  # request id -> pages the transport may still use
        self._owned: set[int] = set()

    def allocate(self, n: int) -> list[int]:
        pages = self.allocator.allocate(n)
        if pages is None:
            raise RuntimeError(f"{n} pages asked, {self.allocator.num_free} free")
        self._owned.update(pages)
        return pages

    def fill(self, page_ids: Sequence[int], seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        index = torch.tensor(list(page_ids))
        shape = (self.pool.shape[0], len(page_ids), *self.pool.shape[2:])
        self.pool[:, index] = torch.randn(shape, generator=gen).to(self.pool.dtype)

    def read(self, page_ids: Sequence[int]) -> bytes:
        data: bytes = (
            self.pool[:, torch.tensor(list(page_ids))].contiguous().view(torch.uint8).numpy().tobytes()
        )
        return data

    def free(self, page_ids: Sequence[int]) -> None:
        self.allocator.decref(page_ids)
        self._owned.difference_update(page_ids)

    def free_unheld(self) -> None:
        """Free every page no transfer may still touch (received pages, spares)."""
        held = {p for pages in self._held.values() for p in pages}
        self.free(sorted(self._owned - held))

    def begin_send(
        self, request_id: str, dest: KVDestination, src: list[int], timeout_s: float, release: bool = True
    ) -> None:
        """``release``: free the source pages when the send is over (else the caller keeps them)."""
        self.transport.begin_send(request_id, dest, src, timeout_s)
        self._held[request_id] = src if release else []

    def send_layers(self, request_id: str, layers: Sequence[int]) -> None:
        for layer in layers:
            self.transport.send_layer(request_id, layer)

    def send_whole(self, request_id: str) -> None:
        self.transport.send_all_layers(request_id)

    def finish_send(self, request_id: str, first_token: int, cached_tokens: int) -> None:
        notification = KVNotification(request_id, first_token, cached_tokens)
        self.transport.finish_send(request_id, notification, time.monotonic())

    def send(
        self,
        request_id: str,
        dest: KVDestination,
        src: list[int],
        layerwise: bool,
        timeout_s: float,
        release: bool = True,
    ) -> None:
        """A whole send as a prefill rank makes it: layers as they are computed, then the notification."""
        self.begin_send(request_id, dest, src, timeout_s, release)
        if layerwise:
            self.send_layers(request_id, range(self.pool.shape[0]))
        else:
            self.send_whole(request_id)
        self.finish_send(request_id, 7, 0)

    def send_timed(
        self, request_id: str, dest: KVDestination, src: list[int], layerwise: bool, timeout_s: float
    ) -> TransferStats:
        """A whole send, then this process polls until the transport reports it over: no Ray call
        falls between the first post and the completion the figures are stamped at. The source
        pages stay with the caller. Raises the transfer's error if it failed. The receiver must
        poll meanwhile (its worker progresses only then, and the send completes only after)."""
        self.send(request_id, dest, src, layerwise, timeout_s, release=False)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            events = self.transport.poll()
            for failure in events.failed:
                self._held.pop(failure.request_id, None)
                if failure.request_id == request_id:
                    raise failure.error
            for stats in events.sent:
                self._held.pop(stats.request_id, None)
                if stats.request_id == request_id:
                    return stats
        raise TimeoutError(f"send {request_id}: not over within {timeout_s}s")

    def connect(self, ranks: list[str]) -> list[str]:
        """Reach these peers ahead of any transfer (the transport's ``connect``); those missed."""
        return self.transport.connect(ranks)

    def warm_messages(self) -> int:
        return int(getattr(self.transport, "warm_messages", 0))

    def expect(self, request_id: str, peer: str, pages: list[int], timeout_s: float) -> None:
        self.transport.expect(request_id, peer, pages, timeout_s)
        self._held[request_id] = pages

    def abort_send(self, request_id: str) -> None:
        self.transport.abort_send(request_id)

    def abort_receive(self, request_id: str) -> None:
        self.transport.abort_receive(request_id)

    def poll(self, wait_s: float) -> PeerEvents:
        """Poll the transport until something happens or ``wait_s`` passes. Failed transfers'
        pages and sent transfers' source pages are freed here; received pages stay with the caller."""
        deadline = time.monotonic() + wait_s
        events = TransportEvents()
        while True:
            got = self.transport.poll()
            events.received += got.received
            events.sent += got.sent
            events.failed += got.failed
            if events or time.monotonic() > deadline:
                break
            time.sleep(0.0005)
        out = PeerEvents()
        for r in events.received:
            out.received[r.notification.request_id] = r.notification
            out.received_stats[r.notification.request_id] = r.stats
            self._held.pop(r.notification.request_id, None)
        for s in events.sent:
            out.sent[s.request_id] = s
            self.free(self._held.pop(s.request_id, []))
        for f in events.failed:
            out.failed[f.request_id] = f
            self.free(self._held.pop(f.request_id, []))
        return out

    def check(self) -> tuple[int, int]:
        """Page accounting holds; returns (free pages, transfers in flight)."""
        self.allocator.check_integrity()
        sends, recvs = self.transport.in_flight()
        return self.allocator.num_free, sends + recvs

    def late_messages_dropped(self) -> int:
        return int(getattr(self.transport, "late_messages_dropped", 0))

    def memcpy_gb_s(self, num_bytes: int, repeats: int = 5) -> float:
        """The same bytes copied within this process (buffers touched first), median of repeats."""
        src = torch.ones(num_bytes, dtype=torch.uint8)
        dst = torch.zeros(num_bytes, dtype=torch.uint8)
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
        return num_bytes / sorted(times)[len(times) // 2] / 1e9

    def pid(self) -> int:
        return os.getpid()

    def close(self) -> None:
        self.transport.close()
