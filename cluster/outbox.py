"""Pushes from a rank's loop thread: stream batches to frontends over their channels, KV events
to subscribers (frontends) as actor calls.

A stream batch goes on the channel its frontend opened to this rank (``cluster/channel_server.py``);
a frontend with no open channel is gone, and what the rank holds for it ends. A KV event push is
a fire-and-forget call; the outcome of an earlier push to the same actor tells whether the cached
handle still reaches a live actor, so a dead subscriber is found without waiting on anything in
the step loop. That outcome is read at most every ``check_every_s`` per actor (reading it costs
about as much as the push itself); a push made in between keeps the older reference, so a
failure is found within one interval.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from tandem.cluster.channel_server import ChannelServer
from tandem.wire.kv_events import KVEventBatch
from tandem.wire.messages import StreamBatch

log = logging.getLogger(__name__)

KV_EVENTS_METHOD = "push_kv_events"


class RayOutbox:
    def __init__(self, owner: str, channels: ChannelServer | None = None, check_every_s: float = 0.2) -> None:
        self.owner = owner
        self.channels = channels
        self.check_every_s = check_every_s
        self._handles: dict[str, Any] = {}  # actor name -> handle
        self._last_push: dict[str, Any] = {}  # actor name -> the push whose outcome is read next
        self._checked_at: dict[str, float] = {}  # actor name -> when that outcome was last read

    def push_stream(self, frontend: str, batch: StreamBatch) -> bool:
        """The batch on the frontend's channel, without waiting; False when it has none."""
        return self.channels is not None and self.channels.send_to(frontend, batch)

    def push_kv_events(self, subscriber: str, batch: KVEventBatch) -> bool:
        return self.send(subscriber, KV_EVENTS_METHOD, batch)

    def flush(self) -> list[str]:
        """Send what the channels did not take at once (every loop iteration); the frontends
        whose channel failed (what it held is lost: their requests must end)."""
        return self.channels.flush() if self.channels is not None else []

    def send(self, actor: str, method: str, payload: Any) -> bool:
        """``actor.method(payload)`` without waiting; False when no such actor lives."""
        now = time.monotonic()
        if actor in self._last_push and now - self._checked_at.get(actor, 0.0) < self.check_every_s:
            return self._push(actor, method, payload, keep_last=True)
        self._checked_at[actor] = now
        last = self._last_push.pop(actor, None)
        if last is not None and ray.wait([last], timeout=0)[0]:
            try:
                ray.get(last, timeout=0)
            except ray.exceptions.RayActorError:  # dead: look the name up again (a restart?)
                self._handles.pop(actor, None)
            except Exception:  # the push itself failed there; the actor lives
                pass
        handle = self._handles.get(actor)
        if handle is None:
            try:
                handle = self._handles[actor] = ray.get_actor(actor)
            except ValueError:
                return False
            except Exception as exc:  # the GCS did not answer: try again next iteration
                log.warning("rank %s: cannot look up %s: %s", self.owner, actor, exc)
                return True
        return self._push(actor, method, payload, keep_last=False)

    def _push(self, actor: str, method: str, payload: Any, keep_last: bool) -> bool:
        handle = self._handles.get(actor)
        if handle is None:
            return False
        try:
            ref = getattr(handle, method).remote(payload)
        except Exception:
            self._handles.pop(actor, None)
            return False
        if not keep_last or actor not in self._last_push:
            self._last_push[actor] = ref
        return True
