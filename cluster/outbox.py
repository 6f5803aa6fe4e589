"""Pushes from a rank's loop thread to named actors (frontends, KV event subscribers).

A push is a fire-and-forget call; the outcome of an earlier push to the same actor tells
whether the cached handle still reaches a live actor, so a dead frontend is found without
waiting on anything in the step loop. That outcome is read at most every ``check_every_s`` per
actor (reading it costs about as much as the push itself); a push made in between keeps the
older reference, so a failure is found within one interval.

Streams (``push_stream`` to a frontend) move to a socket when the actor offers one
(``stream_endpoint``; see ``cluster/stream_socket.py``): the endpoint is asked for without
waiting, and the switch happens once it has come and every push made as an actor call has run
there, so the frontend sees one stream's batches in order. A socket found closed before a batch
is written sends that batch as an actor call instead (a restarted frontend is reached again by
name; a dead one answers False) and the stream starts over; one that fails with bytes still
buffered ends that frontend's requests (``flush``).
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

from tandem.cluster.stream_socket import SocketStream
from tandem.wire.kv_events import KVEventBatch
from tandem.wire.messages import StreamBatch

log = logging.getLogger(__name__)

STREAM_METHOD = "push_stream"
KV_EVENTS_METHOD = "push_kv_events"


class RayOutbox:
    def __init__(self, owner: str, check_every_s: float = 0.2) -> None:
        self.owner = owner
        self.check_every_s = check_every_s
        self._handles: dict[str, Any] = {}  # actor name -> handle
        self._last_push: dict[str, Any] = {}  # actor name -> the push whose outcome is read next
        self._checked_at: dict[str, float] = {}  # actor name -> when that outcome was last read
        self._latest: dict[str, Any] = {}  # actor name -> the newest push made as an actor call
        self._endpoints: dict[str, Any] = {}  # actor name -> its stream_endpoint() reply, coming
        self._sockets: dict[str, SocketStream] = {}
        self._no_socket: set[str] = set()  # actors that offer none: actor calls only

    def push_stream(self, frontend: str, batch: StreamBatch) -> bool:
        return self.send(frontend, STREAM_METHOD, batch)

    def push_kv_events(self, subscriber: str, batch: KVEventBatch) -> bool:
        return self.send(subscriber, KV_EVENTS_METHOD, batch)

    def send(self, actor: str, method: str, payload: Any) -> bool:
        """``actor.method(payload)`` without waiting; False when no such actor lives."""
        if method == STREAM_METHOD:
            stream = self._sockets.get(actor) or self._connect(actor)
            if stream is not None:
                try:
                    stream.send(payload)
                    return True
                except OSError as exc:  # closed before this batch: an actor call decides
                    log.warning("rank %s: the stream to %s failed: %s", self.owner, actor, exc)
                    self._forget(actor)
        ok = self._call(actor, method, payload)
        if ok and method == STREAM_METHOD and actor not in self._no_socket and actor not in self._endpoints:
            handle = self._handles.get(actor)
            if handle is not None and hasattr(handle, "stream_endpoint"):
                self._endpoints[actor] = handle.stream_endpoint.remote()
        return ok

    def flush(self) -> list[str]:
        """Send what the streams' sockets did not take at once (every loop iteration); the
        actors whose stream failed (what it held is lost: their requests must end)."""
        failed = []
        for actor, stream in list(self._sockets.items()):
            try:
                stream.flush()
            except OSError as exc:
                log.warning("rank %s: the stream to %s failed: %s", self.owner, actor, exc)
                self._forget(actor)
                failed.append(actor)
        return failed

    def _connect(self, actor: str) -> SocketStream | None:
        """The actor's socket once its endpoint has come and every actor-call push has run."""
        pending = self._endpoints.get(actor)
        if pending is None:
            return None
        latest = self._latest.get(actor)
        refs = [pending] if latest is None else [pending, latest]
        if len(ray.wait(refs, num_returns=len(refs), timeout=0)[0]) < len(refs):
            return None
        del self._endpoints[actor]
        try:
            endpoint = ray.get(pending, timeout=0)
        except Exception:  # the actor died meanwhile: its next incarnation is asked afresh
            self._forget(actor)
            return None
        try:
            if endpoint is None:
                raise ValueError("it offers no stream endpoint")
            host, port, secret = endpoint
            stream = self._sockets[actor] = SocketStream(host, port, secret)
        except (OSError, ValueError) as exc:  # no route to it: actor calls it is
            log.info("rank %s: streams to %s stay actor calls: %s", self.owner, actor, exc)
            self._no_socket.add(actor)
            return None
        return stream

    def _forget(self, actor: str) -> None:
        stream = self._sockets.pop(actor, None)
        if stream is not None:
            stream.close()
        for table in (self._handles, self._last_push, self._latest, self._endpoints, self._checked_at):
            table.pop(actor, None)
        self._no_socket.discard(actor)

    def _call(self, actor: str, method: str, payload: Any) -> bool:
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
        self._latest[actor] = ref
        return True
