"""Pushes from a rank's loop thread to named actors (frontends, KV event subscribers).

A push is a fire-and-forget call; the outcome of an earlier push to the same actor tells
whether the cached handle still reaches a live actor, so a dead frontend is found without
waiting on anything in the step loop. That outcome is read at most every ``check_every_s`` per
actor (reading it costs about as much as the push itself); a push made in between keeps the
older reference, so a failure is found within one interval.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import ray

log = logging.getLogger(__name__)


class RayOutbox:
    def __init__(self, owner: str, check_every_s: float = 0.2) -> None:
        self.owner = owner
        self.check_every_s = check_every_s
        self._handles: dict[str, Any] = {}  # actor name -> handle
        self._last_push: dict[str, Any] = {}  # actor name -> the push whose outcome is read next
        self._checked_at: dict[str, float] = {}  # actor name -> when that outcome was last read

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
