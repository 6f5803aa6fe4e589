"""A rank loop's pushes to its frontends, on the channels they opened to it
(``cluster/channel_server.py``): each frontend's stream batch, and each subscriber's KV events
(a subscriber is a frontend that sent ``Subscribe`` on its channel). A push never blocks the
loop; one to a frontend with no open channel answers False: that frontend is gone, and what
the rank holds for it (requests, a subscription) ends."""

from __future__ import annotations

from tandem.cluster.channel_server import ChannelServer
from tandem.wire.kv_events import KVEventBatch
from tandem.wire.messages import StreamBatch


class ChannelOutbox:
    def __init__(self, channels: ChannelServer) -> None:
        self.channels = channels

    def push_stream(self, frontend: str, batch: StreamBatch) -> bool:
        return self.channels.send_to(frontend, batch)

    def push_kv_events(self, subscriber: str, batch: KVEventBatch) -> bool:
        return self.channels.send_to(subscriber, batch)

    def flush(self) -> list[str]:
        """Send what the channels did not take at once (every loop iteration); the frontends
        whose channel failed (what it held is lost: their requests must end)."""
        return self.channels.flush()
