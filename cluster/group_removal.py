"""Removing a group without failing a request: drain it, wait until its ranks hold nothing for a
while, then stop it; at the removal's deadline cancel the drain instead. The removals under way
are part of the controller's record, so a restarted controller carries each on (its decision
stands, and so does its deadline).

Called by the controller (``cluster/controller.py``) with its lock, its stop event and two
callbacks: ``save`` writes the record, ``publish`` refreshes the routing view; both are called
with the lock held."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import ray

from tandem.cluster.autoscaling import AutoscalerLoop, DrainTimeout
from tandem.cluster.controller_state import Removal
from tandem.cluster.group import RankGroup
from tandem.cluster.pools import Cluster
from tandem.wire.messages import Role
from tandem.wire.routing_view import GroupState

log = logging.getLogger(__name__)


class GroupRemovals:
    def __init__(
        self,
        cluster: Cluster,
        lock: threading.Lock,
        stopped: threading.Event,
        save: Callable[[], None],
        publish: Callable[[], None],
    ) -> None:
        self.cluster, self._lock, self._stopped = cluster, lock, stopped
        self._save, self._publish = save, publish
        self.pending: dict[str, Removal] = {}  # group id -> its removal under way
        self.drain_timeouts = {role.value: 0 for role in (Role.PREFILL, Role.DECODE)}  # by pool

    def remove(
        self, group_id: str, timeout_s: float, quiet_s: float = 1.0, by_autoscaler: bool = False
    ) -> None:
        """Drain ``group_id``, then stop it once quiet for ``quiet_s``; :class:`DrainTimeout` if
        it still holds requests after ``timeout_s`` (the drain is cancelled)."""
        with self._lock:
            group = self.cluster.group(group_id)
            if group_id in self.cluster.starting:
                raise ValueError(f"{group_id} is still starting; remove it once it serves")
            if not [g for g in self.cluster.taking_work(group.config.role.role) if g is not group]:
                raise ValueError(f"{group_id} is the last group of its pool that takes work; add one first")
            removal = Removal(group_id, time.time(), timeout_s, by_autoscaler)
            self.pending[group_id] = removal
            try:
                self.cluster.drain(group_id)  # saves the record first: a restart resumes the removal
            except BaseException:
                self.pending.pop(group_id, None)
                self._save()  # still draining: the error says why
                raise
            finally:
                self._publish()
        self._await(group, removal, quiet_s)

    def resume(self, removal: Removal, loop: AutoscalerLoop | None) -> None:
        """Carry on a removal a restarted controller found in its record: as the autoscaler's
        action if it decided it, else on a thread of its own."""
        group = self.cluster.group(removal.group_id)

        def step() -> str:
            self._await(group, removal)
            return removal.group_id

        if removal.by_autoscaler and loop is not None:
            loop.resume(group.config.role.role, "drain", step)
            return

        def alone() -> None:
            try:
                step()
            except Exception:
                log.exception("the resumed removal of %s failed", removal.group_id)

        threading.Thread(target=alone, name=f"remove-{removal.group_id}", daemon=True).start()

    def _await(self, group: RankGroup, removal: Removal, quiet_s: float = 1.0) -> None:
        """Wait until the draining group is quiet, then stop it; at the removal's deadline,
        cancel the drain instead (:class:`DrainTimeout`). Returns early if the controller stops
        (it stops every group)."""
        quiet_since: float | None = None
        while True:
            if self._stopped.is_set():
                return
            now = time.monotonic()
            try:
                idle = group.state is not GroupState.READY or self.cluster.idle(group)
            except ray.exceptions.RayError:  # a rank died mid-drain: the watch fails the group
                idle = False
            if idle:
                quiet_since = quiet_since if quiet_since is not None else now
                if now - quiet_since >= quiet_s:
                    break
            else:
                quiet_since = None
            if time.time() > removal.deadline_unix_s:
                self._cancel(group, removal)
                raise DrainTimeout(group.group_id, time.time() - removal.started_unix_s)
            time.sleep(0.1)
        with self._lock:
            self.cluster.forget_group(group)
            self.pending.pop(group.group_id, None)
            self._save()
            self._publish()

    def _cancel(self, group: RankGroup, removal: Removal) -> None:
        with self._lock:
            self.pending.pop(group.group_id, None)
            self._save()
            pool = group.config.role.role.value
            self.drain_timeouts[pool] = self.drain_timeouts.get(pool, 0) + 1
            try:
                if group in self.cluster.groups:
                    self.cluster.undrain(group.group_id)
            except ray.exceptions.RayError as exc:  # a rank died: the watch fails and rebuilds it
                log.warning("cancelling the drain of %s: %s", group.group_id, exc)
            self._publish()
        log.warning(
            "drain of %s cancelled: it still held requests after %.0f s; it takes work again",
            group.group_id,
            removal.timeout_s,
        )
