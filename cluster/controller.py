"""The cluster as a named Ray actor (:class:`Controller`, ``tandem-controller``): frontends and
tools find it by name. It holds the :class:`~tandem.cluster.pools.Cluster` (the two pools and
their groups, ``cluster/pools.py``), watches and rebuilds its groups, registers frontends, runs
the autoscaler, and keeps its record so that a restarted controller adopts the running groups.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import replace
from typing import Any, cast

import ray

from tandem.autoscaler.policy import Autoscaler
from tandem.autoscaler.prometheus_source import PrometheusSource
from tandem.cluster.autoscaling import AutoscalerLoop
from tandem.cluster.controller_state import AutoscalerSettings, ControllerRecord, RecordStore
from tandem.cluster.group_removal import GroupRemovals
from tandem.cluster.pools import Cluster
from tandem.cluster.rank_spec import MetricsSpec
from tandem.cluster.topology import Topology
from tandem.engine.process_place import this_place
from tandem.metrics.controller import AutoscalerFigures, ControllerMetrics, GroupFigures
from tandem.metrics.http import MetricsServer
from tandem.metrics.labels import ControllerLabels
from tandem.wire.autoscaler_decision import Decision
from tandem.wire.messages import RankStats, Role
from tandem.wire.routing_view import FrontendInfo, GroupState, RoutingView
from tandem.wire.scrape_target import ScrapeTarget

log = logging.getLogger(__name__)


@ray.remote(max_concurrency=8)  # type: ignore[call-overload]
class Controller:
    """The cluster as a named Ray actor (``tandem-controller``): frontends and tools find it by
    name. A watch thread looks at the groups and rebuilds failed ones every ``health_interval_s``.

    ``routing_view`` answers from a copy refreshed after every change, without the lock: a
    group's rebuild holds the lock for as long as its ranks take to start, and frontends must
    see the failed group (and route around it) meanwhile."""

    def __init__(
        self,
        topology: Topology,
        model_dir: str,
        dtype: str = "float32",
        health_interval_s: float = 0.5,
        model_name: str = "",
        metrics: MetricsSpec | None = None,
        detached: bool = False,
        deployment: str = "",
    ) -> None:
        self.cluster = Cluster(topology, model_dir, dtype, model_name, metrics, detached, deployment)
        self.health_interval_s = health_interval_s
        self.deployment = deployment
        self.place = this_place()
        self._frontends: dict[str, FrontendInfo] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watch = threading.Thread(target=self._watch_loop, daemon=True)
        self._metrics: MetricsServer | None = None
        self._own_target: tuple[ScrapeTarget, ...] = ()
        self._autoscaler: AutoscalerLoop | None = None
        if metrics is not None:  # the controller's own metrics, served beside the ranks'
            labels = ControllerLabels(self.cluster.model_name)
            figures = ControllerMetrics(labels, self._group_figures, self._autoscaler_figures)
            host = metrics.host or ray.util.get_node_ip_address()
            self._metrics = MetricsServer(figures.registry, host, security=metrics.security)
            self._own_target = (ScrapeTarget(self._metrics.address, "controller", labels.as_dict()),)
        self._settings: AutoscalerSettings | None = None
        self._removals = GroupRemovals(self.cluster, self._lock, self._stop, self._save_record, self._publish)
        self._record = RecordStore(ray.get_runtime_context().namespace)
        self.cluster.on_draining_changed = self._save_record
        self._publish()
        self.rebuilt: list[str] = []
        if ray.get_runtime_context().was_current_actor_reconstructed:  # Ray restarted this actor
            self._resume(self._record.load())
            self._watch.start()
        else:  # a new deployment: nothing of an earlier one of this name is resumed
            self._record.clear()

    def _resume(self, record: ControllerRecord) -> None:
        """After Ray restarted this actor: adopt the running groups with the draining set as it
        was, carry on every removal under way (a drain whose deadline passed meanwhile is
        cancelled at once) and start the autoscaler again with its settings. A removal is
        resumed, not cancelled: the decision to shrink stands, and its deadline is kept."""
        with self._lock:
            self.cluster.restore_draining({*record.draining, *(r.group_id for r in record.removing)})
            adopted = self.cluster.adopt()
            gone = self.cluster.forget_unknown_draining()
            known = {g.group_id for g in self.cluster.groups}
            self._removals.pending = {r.group_id: r for r in record.removing if r.group_id in known}
            self._settings = record.autoscaler
            self._save_record()
            self._publish()
        log.warning(
            "controller restarted: adopted groups %s; draining %s; removing %s%s",
            ", ".join(adopted) or "none",
            ", ".join(sorted(self.cluster.draining)) or "none",
            ", ".join(sorted(self._removals.pending)) or "none",
            f"; forgot draining groups no longer there: {', '.join(gone)}" if gone else "",
        )
        if record.autoscaler is not None:
            self._start_loop(record.autoscaler)
        for removal in list(self._removals.pending.values()):
            self._removals.resume(removal, self._autoscaler)

    def _save_record(self) -> None:
        """What a restarted controller resumes (``cluster/controller_state.py``); called with
        the lock held, whenever the settings, the draining set or the removals change."""
        pending = self._removals.pending
        draining = {*self.cluster.draining, *pending}
        removing = tuple(pending[g] for g in sorted(pending))
        self._record.save(ControllerRecord(self._settings, tuple(sorted(draining)), removing))

    def _publish(self) -> None:
        """A new routing view, after a change (called with the lock held)."""
        self._view = self._routing_view()

    def _routing_view(self) -> RoutingView:
        view = self.cluster.routing_view()
        loop = self._autoscaler
        decisions = loop.recent_decisions(16) if loop is not None else ()
        frontends = tuple(self._frontends[name] for name in sorted(self._frontends))
        own = tuple(f.metrics_target for f in frontends if f.metrics_target is not None) + self._own_target
        return replace(
            view,
            metrics_targets=own + view.metrics_targets,
            autoscaler_decisions=decisions,
            frontends=frontends,
            controller=self.place,
            deployment=self.deployment,
        )

    def store_master_pid(self) -> int | None:
        """The process id of the deployment's own store master (``None``: none, or the
        topology names a running one)."""
        master = self.cluster.store_master
        return master.process.pid if master is not None else None

    def register_frontend(self, info: FrontendInfo) -> None:
        """A frontend tells where it serves; the view lists it (status, metrics discovery)."""
        with self._lock:
            self._frontends[info.name] = info
            self._publish()

    def unregister_frontend(self, name: str) -> None:
        with self._lock:
            self._frontends.pop(name, None)
            self._publish()

    def _autoscaler_figures(self) -> AutoscalerFigures | None:
        loop = self._autoscaler
        if loop is None:
            return None
        return replace(loop.figures(), drain_timeouts=dict(self._removals.drain_timeouts))

    def autoscaler_figures(self) -> AutoscalerFigures | None:
        """The autoscaler's counters (ticks, errors, drain timeouts...); ``None`` when it is off."""
        return self._autoscaler_figures()

    def autoscaler_settings(self) -> AutoscalerSettings | None:
        """What the autoscaler runs with (``None``: it was never started)."""
        return self._settings

    def start_autoscaler(
        self, prometheus_url: str, dry_run: bool = False, drain_timeout_s: float = 300.0
    ) -> None:
        """Run the autoscaling policy every ``interval_s`` of the topology's ``autoscaling:``
        (its defaults without one), reading its signals from the Prometheus at
        ``prometheus_url``; with ``dry_run`` it decides and records but does not act. A drain
        whose group still holds requests after ``drain_timeout_s`` is cancelled. The settings
        are kept where a restarted controller finds them, and it starts the autoscaler again.
        Called again, the autoscaler starts anew with the new settings (actions under way run
        to their end)."""
        settings = AutoscalerSettings(prometheus_url, dry_run, drain_timeout_s)
        with self._lock:
            self._settings = settings
            self._save_record()
        self._start_loop(settings)

    def _start_loop(self, settings: AutoscalerSettings) -> None:
        topology = self.cluster.topology
        config = topology.autoscaling_config()
        window = topology.autoscaling.window if topology.autoscaling else "1m"

        def groups(pool: Role) -> tuple[int, int]:
            views = [g for g in self._view.groups if g.role is pool]
            ready = sum(g.state is GroupState.READY for g in views)
            return ready, sum(g.state in (GroupState.STARTING, GroupState.DRAINING) for g in views)

        def remove(pool: Role) -> str:
            with self._lock:
                newest = self.cluster.taking_work(pool)[-1].group_id
            self._removals.remove(newest, settings.drain_timeout_s, by_autoscaler=True)
            return newest

        source = PrometheusSource(settings.prometheus_url, self.cluster.model_name, window=window)
        loop = AutoscalerLoop(
            Autoscaler(config),
            source,
            groups,
            lambda pool: self.add_group(pool.value),
            remove,
            settings.dry_run,
        )
        previous, self._autoscaler = self._autoscaler, loop
        if previous is not None:
            previous.stop()
        loop.start()

    def autoscaler_tick(self) -> list[Decision]:
        """One tick of the autoscaler now (it must have been started): for tools and tests. It
        returns once the decisions are made; their actions run on (``wait_autoscaler``)."""
        loop = self._autoscaler
        if loop is None:
            raise RuntimeError("the autoscaler is not running: start_autoscaler first")
        decisions = loop.tick()
        self._publish()
        return decisions

    def wait_autoscaler(self, timeout_s: float = 300.0) -> bool:
        """Wait until the autoscaler has no action under way; whether it has none."""
        loop = self._autoscaler
        return loop.wait_actions(timeout_s) if loop is not None else True

    def _group_figures(self) -> list[GroupFigures]:
        """From the last published view: a scrape never waits on a rebuild. A group is started
        once, then once per rebuild that was placed, so its restarts are its incarnation - 1
        (tries that found no room are not counted: ``unplaceable`` says so)."""
        return [
            GroupFigures(
                v.group_id,
                v.role.value,
                v.state,
                v.incarnation,
                max(v.incarnation - 1, 0),
                len(v.ranks),
                v.unplaceable,
            )
            for v in self._view.groups
        ]

    def start(self) -> dict[str, str]:
        with self._lock:
            self.cluster.start()
            self._publish()
        self._watch.start()
        return self.cluster.status()

    def _check_frontends(self, timeout_s: float = 5.0) -> None:
        """Each registered frontend: one Ray restarted (its node or process was lost) is
        started again and re-registered where it now runs; one that is gone for good is
        forgotten, so status and metrics discovery list only the living. A frontend still
        restarting is asked again next time."""
        for name in list(self._frontends):
            try:
                handle: Any = ray.get_actor(name)
                ref: ray.ObjectRef = handle.ensure_started.remote()
                info = cast(FrontendInfo, ray.get(ref, timeout=timeout_s))
            except (ValueError, ray.exceptions.ActorDiedError):
                log.warning("frontend %s is gone", name)
                self.unregister_frontend(name)
                continue
            except (ray.exceptions.RayError, TimeoutError):
                continue
            if info != self._frontends.get(name):
                self.register_frontend(info)

    def _watch_loop(self) -> None:
        next_prune = 0.0
        while not self._stop.is_set():
            try:
                if time.monotonic() >= next_prune:
                    self._check_frontends()
                    next_prune = time.monotonic() + 2.0
                with self._lock:
                    self.cluster.watch()
                    self._publish()  # a failure shows before the rebuild
                with self._lock:
                    rebuilt = self.cluster.heal()
                    if rebuilt:
                        self.rebuilt += rebuilt
                        self._publish()
                if self._autoscaler is not None:
                    self._autoscaler.ensure_running()
            except Exception:  # a rebuild that failed is tried again; the watch never stops
                log.exception("controller: watching the groups failed")
            self._stop.wait(self.health_interval_s / 10)

    def status(self) -> dict[str, str]:
        with self._lock:
            return self.cluster.status()

    def routing_view(self) -> RoutingView:
        return self._view

    def stats(self) -> list[RankStats]:
        with self._lock:
            return self.cluster.stats()

    def check_integrity(self) -> None:
        with self._lock:
            self.cluster.check_integrity()

    def drain(self, group_id: str) -> None:
        with self._lock:
            self.cluster.drain(group_id)
            self._publish()

    def add_group(self, role: str) -> str:
        """Start one more group in ``role``'s pool ("prefill" or "decode"); its id once it takes
        work. Frontends, the decode ranks and metrics discovery see it from the next view.

        The start runs without the lock: adds overlap one another (the autoscaler's several
        groups of one decision start side by side), and the watch, rebuilds, drains and status
        go on meanwhile. Until it ends the group is ``starting``, which the others leave alone
        (a failed start is this call's to clean up, not the watch's to rebuild)."""
        with self._lock:
            group = self.cluster.new_group(Role(role))
            self.cluster.starting.add(group.group_id)
            self._publish()
        try:
            group.start()
        except BaseException:
            with self._lock:
                self.cluster.starting.discard(group.group_id)
                self.cluster.forget_group(group)
                self._publish()
            raise
        with self._lock:
            self.cluster.starting.discard(group.group_id)
            if self._stop.is_set():  # stopped while this group started: it goes too
                self.cluster.forget_group(group)
                self._publish()
                raise RuntimeError(f"the controller stopped while {group.group_id} started")
            self.cluster.joined(group)
            self._publish()
        return group.group_id

    def remove_group(self, group_id: str, timeout_s: float = 300.0, quiet_s: float = 1.0) -> None:
        """Drain a group, wait until its ranks hold nothing for ``quiet_s`` (requests routed on a
        view just before the drain land first), then stop it and free its placement group. No
        request fails for it: a drained decode rank refuses new requests and their frontends
        route them elsewhere; a drained prefill group gets no new jobs. A group that still holds
        requests after ``timeout_s`` is not stopped: the drain is cancelled, the group takes work
        again and :class:`DrainTimeout` is raised."""
        self._removals.remove(group_id, timeout_s, quiet_s)

    def stop(self) -> None:
        """Stop the autoscaler and every group; a clean stop leaves nothing to resume."""
        self._stop.set()
        if self._autoscaler is not None:
            self._autoscaler.stop()
        with self._lock:
            self._record.clear()
            self.cluster.stop()
            self._publish()
        if self._metrics is not None:
            self._metrics.close()
