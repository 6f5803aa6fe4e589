"""What crosses between ranks in a KV transfer: pool layouts, destinations, the completion
notification, per-transfer statistics, and the typed errors."""

from __future__ import annotations

import base64
import json
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Protocol

from tandem.kvtransfer.regions import TransferLayout, one_region


@dataclass(frozen=True)
class PoolLayout:
    """Where a rank's KV pool lives and how it is laid out (bytes)::

        base_address
        | layer 0: page 0 | page 1 | ... | page P-1 | layer 1: page 0 | ...
        |<- page_stride ->|                           |
        |<------------------- layer_stride ---------->|

    Page ``p`` of layer ``l`` starts at ``base_address + l*layer_stride + p*page_stride`` and is
    ``page_bytes`` long (``page_size`` tokens of ``token_dim`` numbers of ``dtype``).
    """

    base_address: int
    num_layers: int
    num_pages: int
    page_size: int
    token_dim: int
    dtype: str
    layer_stride_bytes: int
    page_stride_bytes: int
    page_bytes: int
    mem_type: str = "DRAM"
    device_id: int = 0

    def page_address(self, layer: int, page: int) -> int:
        return self.base_address + layer * self.layer_stride_bytes + page * self.page_stride_bytes

    def as_transfer(self, name: str = "kv") -> TransferLayout:
        """The pool as a transfer's one region (``kvtransfer/regions.py``)."""
        region = one_region(
            name,
            self.base_address,
            self.num_layers,
            self.num_pages,
            self.layer_stride_bytes,
            self.page_stride_bytes,
            self.page_bytes,
            self.dtype,
        )
        return TransferLayout((region,), self.num_layers, self.page_size, self.mem_type, self.device_id)

    def compatible_with(self, other: PoolLayout) -> str | None:
        """Why a transfer between the two pools is impossible, or ``None``."""
        for name in ("num_layers", "page_size", "token_dim", "dtype", "page_bytes"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} differs: {getattr(self, name)} here, {getattr(other, name)} there"
        return None


class ReadyEvent(Protocol):
    """Completes once the work queued before it on the device has run (a CUDA event recorded on
    the compute stream). A write of a layer's pages is posted only once the event recorded after
    that layer's kernels completes.

    ``query`` never blocks: whether it has completed. ``synchronize`` blocks the calling thread
    until it has completed and releases the GIL meanwhile (``torch.cuda.Event`` does both), so a
    transport may wait for it on a thread of its own while the forward goes on; it is called from
    that thread, never from the step's. Once completed, an event stays completed."""

    def query(self) -> bool: ...

    def synchronize(self) -> None: ...


class _Ready:
    """The event of a device whose work is done when the call that queued it returns (CPU)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def __repr__(self) -> str:
        return "READY"


READY: ReadyEvent = _Ready()


@dataclass(frozen=True)
class RankMetadata:
    """Published once per rank incarnation; peers fetch and cache it."""

    rank: str
    incarnation: int
    agent_name: str
    agent_metadata: bytes
    layout: TransferLayout


@dataclass(frozen=True)
class KVDestination:
    """Pages a decode rank reserved for one request; travels with the prefill job. ``state_slot``:
    the slot of per-request state it reserved too, where the pool has one (DeepSeek-V4)."""

    rank: str
    incarnation: int
    page_ids: tuple[int, ...]
    state_slot: int | None = None


@dataclass(frozen=True)
class SenderTimings:
    """The prefill rank's own figures for one request, each the difference of two readings of its
    monotonic clock (the bill's ``PrefillAttempt`` in ``wire/messages.py`` carries them on)."""

    prefill_pickup_s: float = 0.0  # the job reached the rank -> on its loop
    prefill_queue_s: float = 0.0  # on the loop -> its first chunk scheduled
    prefill_compute_s: float = 0.0  # first chunk scheduled -> the last layer computed
    kv_transfer_s: float = 0.0  # set by the transport: first write posted -> last write completed
    kv_sender_exposed_s: float = 0.0  # set by the transport: last layer computed -> notified

    @staticmethod
    def parse(raw: Any) -> SenderTimings:
        """From a message's ``timings`` mapping (``ValueError``/``TypeError`` when malformed); a
        figure it lacks is 0, one it does not know is dropped."""
        given = dict(raw or {})
        return SenderTimings(**{f.name: float(given.get(f.name, 0.0)) for f in fields(SenderTimings)})


@dataclass(frozen=True)
class KVNotification:
    """Sent once, after the last write of a request landed, with the sender's own ``timings``;
    ``kv_bytes`` is what its write descriptors covered. ``draft_state``: what the decode rank's
    drafter starts from (with MTP, the prompt's last hidden state as float32 bytes), or empty.
    ``cached_tokens`` is the prompt's prefix the sender did not compute; ``cached_host_tokens``
    and ``cached_store_tokens`` are the parts of it it loaded from its host tier and from the
    shared store (the rest was in its device pages)."""

    request_id: str
    first_token: int
    cached_tokens: int
    timings: SenderTimings = field(default_factory=SenderTimings)
    kv_bytes: int = 0
    draft_state: bytes = b""
    cached_host_tokens: int = 0
    cached_store_tokens: int = 0
    # when the request asked for them, its logprobs as the sender's engine encoded them (JSON
    # values: the first output's and the prompt's); the transport carries them unread
    logprobs: dict[str, Any] | None = None

    @property
    def cached_device_tokens(self) -> int:
        return self.cached_tokens - self.cached_host_tokens - self.cached_store_tokens


@dataclass
class TransferStats:
    """One side's readings of one transfer, on that side's monotonic clock. Sender: ``start_s``
    its first post, ``end_s`` its last write completed, ``compute_done_s`` the last layer
    computed (when the host saw its ready event complete, where it was not at once),
    ``notified_s`` the notification sent. Receiver: ``start_s`` the expectation,
    ``end_s`` the notification seen."""

    request_id: str
    peer: str
    bytes: int = 0
    layers_written: int = 0
    descriptors: int = 0
    start_s: float = 0.0
    end_s: float = 0.0
    compute_done_s: float = 0.0
    notified_s: float = 0.0

    @property
    def duration_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def sender_exposed_s(self) -> float:
        """Sender: last layer computed -> notification sent."""
        return self.notified_s - self.compute_done_s

    @property
    def gb_s(self) -> float:
        return self.bytes / self.duration_s / 1e9 if self.duration_s > 0 else 0.0


class KVTransferError(RuntimeError):
    """A transfer that will not complete; the pages it used may be freed on this side."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(f"KV transfer of {request_id}: {message}")
        self.request_id = request_id
        self.detail = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (KVTransferError, (self.request_id, self.detail))


class KVTransferTimeout(KVTransferError):
    def __init__(self, request_id: str, peer: str, waited_s: float) -> None:
        super().__init__(request_id, f"no completion from {peer} within {waited_s:.1f}s")
        self.peer, self.waited_s = peer, waited_s

    def __reduce__(self) -> tuple[Any, ...]:
        return (KVTransferTimeout, (self.request_id, self.peer, self.waited_s))


class KVTransferAborted(KVTransferError):
    def __init__(self, request_id: str, by: str) -> None:
        super().__init__(request_id, f"aborted by {by}")
        self.by = by

    def __reduce__(self) -> tuple[Any, ...]:
        return (KVTransferAborted, (self.request_id, self.by))


class StalePeerError(KVTransferError):
    """The destination names an incarnation of the peer other than the one published."""

    def __init__(self, request_id: str, peer: str, wanted: int, published: int | None) -> None:
        super().__init__(request_id, f"peer {peer} incarnation {wanted} is not published (found {published})")
        self.peer, self.wanted, self.published = peer, wanted, published

    def __reduce__(self) -> tuple[Any, ...]:
        return (StalePeerError, (self.request_id, self.peer, self.wanted, self.published))


class PeerLost(KVTransferError):
    """The peer's incarnation is gone, its process confirmed dead by the controller: nothing of
    it can write into this side's pages any more, so they are free at once."""

    def __init__(self, request_id: str, peer: str) -> None:
        super().__init__(request_id, f"peer {peer} was lost (its group failed)")
        self.peer = peer

    def __reduce__(self) -> tuple[Any, ...]:
        return (PeerLost, (self.request_id, self.peer))


def failure_cause(error: KVTransferError) -> str:
    """A failed transfer's cause as a metric label: timeout, aborted, stale_peer, peer_lost or
    error."""
    if isinstance(error, PeerLost):
        return "peer_lost"
    if isinstance(error, KVTransferTimeout):
        return "timeout"
    if isinstance(error, KVTransferAborted):
        return "aborted"
    if isinstance(error, StalePeerError):
        return "stale_peer"
    return "error"


class FailureCounts:
    """Failed transfers since start, by direction (``send``/``recv``) and cause."""

    def __init__(self) -> None:
        self._counts: dict[tuple[str, str], int] = {}

    def add(self, direction: str, error: KVTransferError) -> None:
        key = (direction, failure_cause(error))
        self._counts[key] = self._counts.get(key, 0) + 1

    def as_tuple(self) -> tuple[tuple[str, str, int], ...]:
        """``(direction, cause, count)`` rows, as ``RankStats.transfer_failures`` holds them."""
        return tuple((direction, cause, n) for (direction, cause), n in sorted(self._counts.items()))


# -- notification wire format: one small JSON object ---------------------------------------------

DONE, ABORT, ABORT_ACK = "done", "abort", "abort_ack"
WARM = "warm"  # a connect's first message: it wires the channel up, the receiver drops it


def encode_message(kind: str, request_id: str, sender: str, **fields: Any) -> bytes:
    return json.dumps({"kind": kind, "request_id": request_id, "sender": sender, **fields}).encode()


def decode_message(raw: bytes) -> dict[str, Any] | None:
    try:
        msg = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    return msg if isinstance(msg, dict) and {"kind", "request_id", "sender"} <= msg.keys() else None


def notification_fields(n: KVNotification) -> dict[str, Any]:
    """The notification's fields other than the request id (which every message carries)."""
    fields = asdict(n)
    del fields["request_id"]
    fields["draft_state"] = base64.b64encode(n.draft_state).decode()
    return fields
