"""What a rank's workers push to other processes, as an interface: the step loop's token streams
and results to frontends, and the prefix cache's KV events to their subscribers. Each push is
fire and forget and answers whether the receiver still lives; ``cluster/outbox.py``'s
``ChannelOutbox`` is the implementation a rank runs."""

from __future__ import annotations

from typing import Protocol

from tandem.wire.kv_events import KVEventBatch
from tandem.wire.messages import StreamBatch


class Outbox(Protocol):
    def push_stream(self, frontend: str, batch: StreamBatch) -> bool:
        """One step's tokens and results for ``frontend``'s requests; False when it is gone
        (its requests must end)."""
        ...

    def push_kv_events(self, subscriber: str, batch: KVEventBatch) -> bool:
        """KV events for ``subscriber``; False when it is gone (it is unsubscribed)."""
        ...

    def flush(self) -> list[str]:
        """Send what is still buffered (each loop iteration); the frontends whose stream failed
        with bytes buffered (their requests must end)."""
        ...
