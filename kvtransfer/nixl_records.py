"""What :class:`~tandem.kvtransfer.nixl_transport.NixlTransport` keeps of each peer and each
transfer, and how a DONE message's fields become a notification again.

A send's layers are handed over in groups, each with the ready event that says its KV is there
(:class:`Layers`); they wait in order and are posted as their events complete. A receive is its
reserved pages and deadlines; once aborting it waits for the sender's ABORT_ACK until
``ack_deadline``.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import time
from dataclasses import dataclass, field
from typing import Any

from tandem.kvtransfer.descriptors import PageRun
from tandem.kvtransfer.types import (
    READY,
    KVNotification,
    KVTransferError,
    RankMetadata,
    ReadyEvent,
    SenderTimings,
    TransferStats,
)


@dataclass
class Peer:
    meta: RankMetadata
    dlist: Any  # prepared descriptor list of the peer's pool


@dataclass(eq=False)
class Layers:
    """Layers handed over with one ready event, waiting to be posted."""

    layers: list[int]
    ready: ReadyEvent
    done_s: float | None = None  # when the watcher saw ``ready`` complete

    def complete(self) -> bool:
        return self.ready is READY or self.done_s is not None


@dataclass
class Send:
    request_id: str
    peer: Peer
    runs: dict[str, list[PageRun]]  # each region's runs of entries (pages, or the slot)
    stats: TransferStats
    deadline: float
    posted: list[Any] = field(default_factory=list)  # transfer handles in flight or done
    waiting: list[Layers] = field(default_factory=list)  # handed over, not posted yet, in order
    device_done_s: float = 0.0  # the latest completion the watcher stamped among posted layers
    layers_sent: set[int] = field(default_factory=set)  # handed over, posted or waiting
    whole: bool = False
    notification: KVNotification | None = None
    error: KVTransferError | None = None  # set once aborting
    # the receiver asked for the abort: it is told with ABORT_ACK, once no write is in flight
    receiver_aborted: bool = False

    def all_posted(self, num_layers: int) -> bool:
        return self.notification is not None and len(self.layers_sent) == num_layers and not self.waiting

    def completed(self) -> KVNotification:
        """Once every write is done: the notification with the sender's figures. The last
        layer's KV was in the pool when the watcher saw its event complete, which is after the
        host queued it, so the compute figures end there (with events complete when handed
        over, the caller's figure stands)."""
        assert self.notification is not None
        queued_s = self.stats.compute_done_s
        self.stats.compute_done_s = max(queued_s, self.device_done_s)
        device_lag_s = self.stats.compute_done_s - queued_s
        timings = dataclasses.replace(
            self.notification.timings,
            prefill_compute_s=self.notification.timings.prefill_compute_s + device_lag_s,
            kv_transfer_s=self.stats.duration_s,
            kv_sender_exposed_s=self.stats.sender_exposed_s,
        )
        return dataclasses.replace(self.notification, timings=timings, kv_bytes=self.stats.bytes)


@dataclass
class Recv:
    request_id: str
    peer_rank: str
    page_ids: tuple[int, ...]
    start: float
    deadline: float
    error: KVTransferError | None = None  # set once aborting
    ack_deadline: float = 0.0


def seconds_until(deadline_unix_s: Any, grace_s: float) -> float:
    """Seconds from now until a wall-clock deadline a peer sent, plus ``grace_s`` for clocks that
    disagree; a missing or malformed one counts as no time at all."""
    try:
        return max(0.0, float(deadline_unix_s) - time.time()) + grace_s
    except (TypeError, ValueError):
        return grace_s


def parse_notification(request_id: str, msg: dict[str, Any]) -> KVNotification | None:
    """The DONE message's notification, or ``None`` when a field is missing or of the wrong type."""
    try:
        timings = SenderTimings.parse(msg.get("timings"))
        first_token, cached = msg["first_token"], msg["cached_tokens"]
        kv_bytes = msg.get("kv_bytes") or 0
        host, store = msg.get("cached_host_tokens") or 0, msg.get("cached_store_tokens") or 0
        if not all(type(v) is int and v >= 0 for v in (first_token, cached, kv_bytes, host, store)):
            return None
        if host + store > cached:
            return None
        state = base64.b64decode(msg.get("draft_state") or "", validate=True)
        logprobs = msg.get("logprobs")
        if logprobs is not None and not isinstance(logprobs, dict):
            return None
        return KVNotification(
            request_id, first_token, cached, timings, kv_bytes, state, host, store, logprobs
        )
    except (KeyError, TypeError, ValueError, binascii.Error):
        return None
