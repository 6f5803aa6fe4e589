"""Pushes from a rank's loop thread to named actors (frontends, KV event subscribers).

A push is a fire-and-forget call; the outcome of the previous push to the same actor tells
whether the cached handle still reaches a live actor, so a dead frontend is found without
waiting on anything in the step loop.
"""

from __future__ import annotations

import logging
from typing import Any

import ray

log = logging.getLogger(__name__)


class RayOutbox:
    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._handles: dict[str, Any] = {}  # actor name -> handle
        self._last_push: dict[str, Any] = {}  # actor name -> the latest push's object ref

    def send(self, actor: str, method: str, payload: Any) -> bool:
        """``actor.method(payload)`` without waiting; False when no such actor lives."""
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
        try:
            self._last_push[actor] = getattr(handle, method).remote(payload)
        except Exception:
            self._handles.pop(actor, None)
            return False
        return True
