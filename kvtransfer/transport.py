"""The KV transport interface and its registry.

A rank has one transport. As a sender (prefill) it writes a request's pages into the pages a
receiver (decode) reserved, layer by layer as they are computed or all at once, then notifies; as
a receiver it is told what to expect and polls. Nothing here knows group sizes: ranks are names.

On a device whose kernels run asynchronously, the sender hands each layer over with a
:class:`ReadyEvent` recorded after that layer's kernels; a write is posted only once its event
completes, so no write reads KV the device has not produced yet. The caller's thread never waits
on the device: a transport that waits for events does so on a thread of its own (NIXL's watcher),
so a layer's writes leave while the forward is still running.

Pages are owned by the schedulers, not by the transport: a side may free a request's pages only
once :meth:`KVTransport.poll` reports that request finished or failed on that side, which the
transport does only when no write can still touch them. Every wait has a deadline.

    sender                                   receiver
    begin_send(dest) ─┐                      expect(request, pages, deadline)
    send_layer(0..L-1)│ WRITEs               │
    finish_send(n) ───┘ + notification ───▶  poll(): received(n)   ─ decode may use the pages
    poll(): sent(stats)                      abort_receive ─▶ sender stops, acks ─▶ failed
    abort_send ─▶ writes drained, receiver told ─▶ failed on both sides
    fence_peer(dead rank) ─▶ its transfers fail at once on this side (no ack to wait for)
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from tandem.kvtransfer.metadata import MetadataStore
from tandem.kvtransfer.regions import TransferLayout
from tandem.kvtransfer.types import (
    READY,
    KVDestination,
    KVNotification,
    KVTransferError,
    PoolLayout,
    ReadyEvent,
    TransferStats,
)


@dataclass(frozen=True)
class ReceivedKV:
    notification: KVNotification
    stats: TransferStats


@dataclass(frozen=True)
class TransferFailure:
    request_id: str
    role: str  # "send" or "recv"
    error: KVTransferError


@dataclass
class TransportEvents:
    received: list[ReceivedKV] = field(default_factory=list)
    sent: list[TransferStats] = field(default_factory=list)
    failed: list[TransferFailure] = field(default_factory=list)
    # sender: receivers that gave up on a transfer not begun yet; drop the job, then
    # ``confirm_cancelled`` (a job that has not arrived yet: check ``is_cancelled`` when it does)
    cancelled: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.received or self.sent or self.failed or self.cancelled)


class KVTransport(ABC):
    name: ClassVar[str]
    layerwise: ClassVar[bool] = True  # can post a layer's writes before the next is computed

    rank: str
    incarnation: int

    @abstractmethod
    def __init__(
        self, rank: str, incarnation: int, layout: PoolLayout | TransferLayout, store: MetadataStore
    ) -> None:
        """Register ``layout``'s regions once and publish this rank's metadata in ``store``."""

    @abstractmethod
    def begin_send(
        self,
        request_id: str,
        dest: KVDestination,
        src_page_ids: Sequence[int],
        timeout_s: float,
        src_slot: int | None = None,
    ) -> None:
        """Start a transfer of ``src_page_ids`` (in token order) into ``dest.page_ids``, and of
        slot ``src_slot`` into ``dest.state_slot`` where the layout has slots of state."""

    @abstractmethod
    def send_layer(self, request_id: str, layer: int, ready: ReadyEvent = READY) -> None:
        """Post the writes of one layer once ``ready`` completes (its kernels have run)."""

    @abstractmethod
    def send_all_layers(self, request_id: str) -> None:
        """Whole-request mode: every layer in one transfer, posted with the notification."""

    @abstractmethod
    def finish_send(
        self,
        request_id: str,
        notification: KVNotification,
        compute_done_s: float,
        ready: ReadyEvent = READY,
    ) -> None:
        """Every layer is queued; in whole-request mode the writes are posted once ``ready``
        completes. Notify the receiver once all writes have landed.

        ``compute_done_s`` is when the host queued the last layer, and the notification's
        ``timings.prefill_compute_s`` ends at that same moment. Where the last layer's event was
        not complete then (a GPU's), the transport moves that end to the moment it saw the event
        complete (the device's completion, on the host's monotonic clock): the compute figure
        grows by the difference, and the exposed figure starts there. With events complete when
        handed over (a CPU's), both figures are the caller's."""

    @abstractmethod
    def abort_send(self, request_id: str) -> None: ...

    @abstractmethod
    def is_cancelled(self, request_id: str) -> bool:
        """Sender: the receiver gave this transfer up before it began (its job must not run)."""

    @abstractmethod
    def confirm_cancelled(self, request_id: str) -> None:
        """Sender: the cancelled job is dropped and will never write; the receiver is told."""

    @abstractmethod
    def expect(self, request_id: str, peer_rank: str, page_ids: Sequence[int], timeout_s: float) -> None:
        """Receiver side: ``page_ids`` are reserved for ``request_id``, to be written by ``peer_rank``."""

    @abstractmethod
    def abort_receive(self, request_id: str) -> None: ...

    @abstractmethod
    def fence_peer(self, rank: str) -> None:
        """``rank``'s current incarnation is dead (the caller has proof: its process is gone):
        forget its agent, and fail every transfer with it at once, reported by the next
        ``poll``; its pages on this side are free, since nothing of it can write any more."""

    def connect(self, ranks: Sequence[str]) -> list[str]:
        """Reach these peers now, before any transfer with them (a membership change calls it):
        their published metadata fetched, their pools' descriptors prepared and the channel
        wired up, so a first transfer pays none of it. A peer already reached is skipped. The
        ranks not reachable yet are returned: their first transfer connects, as without this.
        By default a transport connects at first contact and reaches none ahead."""
        return list(ranks)

    def connected_peers(self) -> int:
        """How many peers this transport has reached (ahead of, or at, a first transfer)."""
        return 0

    @abstractmethod
    def poll(self) -> TransportEvents: ...

    @abstractmethod
    def in_flight(self) -> tuple[int, int]:
        """(sends, receives) not yet reported by ``poll``."""

    @abstractmethod
    def close(self) -> None: ...
