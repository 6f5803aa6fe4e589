"""The one channel between a frontend and a rank: one TCP connection, opened by the frontend,
that carries the submit path, the stream path and the rank's KV events.

    frontend -> rank, once:  SECRET (``SECRET_BYTES``, the rank's, handed out by its actor),
                             then a frame ``Hello(frontend)``
    frontend -> rank, each:  a frame ``Submit(seq, requests)``, ``Abort(request_ids)`` or
                             ``Subscribe(seq)``
    rank -> frontend, each:  a frame ``Answer(seq, refusal)`` (one a submit or subscribe, in
                             their order), a ``StreamBatch`` (the rank's tokens and results for
                             this frontend, once a step) or a ``KVEventBatch`` (the rank's
                             prefix-cache events: the snapshot a subscribe asked for, sent
                             before its answer, then each step's)

Every frame is ``wire/framing.py``'s, under its one limit. The rank reads one connection's
frames in order on one thread, so an ``Abort`` sent after a ``Submit`` finds its request, and a
submit is answered before the next is read. A refusal is an answer, never the end of the
connection: ``(True, why)`` when the rank is being drained (the frontend routes the request
again), ``(False, why)`` for anything else (the request fails). A connection that does not open
with the secret and a hello, or sends a frame too large or not of this module, is closed.

Ray actor calls stay for control only (start, stop, membership, status, the endpoint below).
Both ends (``cluster/channel_server.py`` on the rank, ``frontend/rank_channel.py`` on the
frontend) are a :class:`Channel`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from tandem.wire.messages import RankRequest

SECRET_BYTES = 16
HELLO_TIMEOUT_S = 5.0  # a connection that has not said who it is by then is closed
# bytes a rank keeps for a frontend that does not read them before it counts the frontend gone
MAX_BUFFERED_BYTES = 64 << 20

Refusal = tuple[bool, str]  # (the rank is being drained, why it refused)


@dataclass(frozen=True)
class Endpoint:
    """Where a rank's channels are opened: its listening address and the secret they open with."""

    host: str
    port: int
    secret: bytes


@dataclass(frozen=True)
class Hello:
    """A frontend's first frame: who it is, so the rank streams it its batches on this channel."""

    frontend: str


@dataclass(frozen=True)
class Submit:
    seq: int  # the frontend's count of its submits on this channel, from 1
    requests: tuple[RankRequest, ...]


@dataclass(frozen=True)
class Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class Subscribe:
    """Send this frontend the rank's KV events from now on: a snapshot (``seq`` 0), then batches
    1, 2, ... (``wire/kv_events.py``); it ends with the channel."""

    seq: int  # counted with the submits


@dataclass(frozen=True)
class Answer:
    seq: int  # the submit or subscribe it answers
    refusal: Refusal | None = None  # None: the rank took every request of it


class Channel(Protocol):
    """Either end of a channel."""

    @property
    def is_open(self) -> bool: ...

    def send(self, message: Any) -> None:
        """Frame ``message`` and send it without blocking; ``ConnectionError`` when the channel
        has ended (or the peer has stopped reading)."""

    def close(self) -> None: ...
