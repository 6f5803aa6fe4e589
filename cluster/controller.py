"""A disaggregated cluster built from a topology: the prefill pool and the decode pool.

:class:`Cluster` starts every group, tells each decode rank the prefill ranks (membership), and
watches the groups: a failed group is rebuilt whole and the membership sent again. Groups are
added and removed at runtime (:meth:`Controller.add_group`, :meth:`Controller.remove_group`): a
removed group is drained first, so no request fails for it. Requests do
not pass through here: frontends route them to ranks themselves, from the ``routing_view``.
:class:`Controller` is the cluster as a named Ray actor, so frontends and tools find it by name.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any, cast

import ray

from tandem.autoscaler.policy import Autoscaler
from tandem.autoscaler.prometheus_source import PrometheusSource
from tandem.cluster.autoscaling import AutoscalerLoop, DrainTimeout
from tandem.cluster.controller_state import AutoscalerSettings, ControllerRecord, RecordStore, Removal
from tandem.cluster.group import GroupConfig, GroupFailed, RankGroup, parse_rank_actor_name, start_groups
from tandem.cluster.kv_store_master import StoreMaster, refuse_untrusted_nodes
from tandem.cluster.placement import RankResources
from tandem.cluster.rank_spec import MetricsSpec
from tandem.cluster.store_secret import store_secret
from tandem.cluster.topology import PoolSpec, StoreSpec, Topology
from tandem.decode.role import DecodeRole
from tandem.engine.colocated_role import ColocatedRole
from tandem.engine.engine_config import EngineConfig
from tandem.engine.process_place import this_place
from tandem.engine.role_spec import RoleSpec
from tandem.kvtransfer.bind_guard import guard_library, preload_env
from tandem.kvtransfer.kv_store import StoreConfig
from tandem.metrics.controller import AutoscalerFigures, ControllerMetrics, GroupFigures
from tandem.metrics.http import MetricsServer
from tandem.metrics.labels import ControllerLabels, RankLabels
from tandem.prefill.role import PrefillRole
from tandem.wire.autoscaler_decision import Decision
from tandem.wire.messages import RankId, RankStats, Role
from tandem.wire.routing_view import FrontendInfo, GroupState, GroupView, RoutingView
from tandem.wire.scrape_target import ScrapeTarget

log = logging.getLogger(__name__)


class Cluster:
    """``metrics``: where each rank serves its Prometheus metrics (``host`` empty: its node's
    address), with what token and TLS; ``None``: no rank serves metrics."""

    def __init__(
        self,
        topology: Topology,
        model_dir: str,
        dtype: str = "float32",
        model_name: str = "",
        metrics: MetricsSpec | None = None,
        detached: bool = False,
        deployment: str = "",
    ) -> None:
        self.topology = topology
        self.model_name = model_name or model_dir.rstrip("/").rsplit("/", 1)[-1]
        resources = RankResources.detect(topology.cpus_per_rank)

        per_rank = topology.pin_cores_per_rank

        def groups(name: str, pool: PoolSpec, role: RoleSpec) -> list[RankGroup]:
            first = self._next_ordinal
            self._next_ordinal += pool.ranks
            template = GroupConfig(
                f"{name}0",
                model_dir,
                pool.dep,
                role,
                dtype,
                resources,
                metrics=metrics,
                placement=topology.placement,
                detached=detached,
                deployment=deployment,
                env=self._rank_env,
            )
            self._templates[role.role] = template
            self._next_index[role.role] = pool.groups
            return [
                RankGroup(replace(template, group_id=f"{name}{i}", cores=cores(first + i * pool.dep)))
                for i in range(pool.groups)
            ]

        def cores(ordinal: int) -> tuple[int, int] | None:
            return None if per_rank is None else (ordinal, per_rank)

        self._templates: dict[Role, GroupConfig] = {}
        self._next_index: dict[Role, int] = {}
        self._next_ordinal = 0  # of the next group's first rank, for core pinning

        self._draining: set[str] = set()
        self.on_draining_changed: Callable[[], None] = lambda: None  # before ranks hear of it
        self._retry_at: dict[str, float] = {}  # failed group -> monotonic time of its next rebuild
        self.starting: set[str] = set()  # groups ``Controller.add_group`` starts outside the lock
        self.store_master: StoreMaster | None = None
        self._rank_env: tuple[tuple[str, str], ...] = ()  # what each rank's process starts with
        store = self._store_config(topology.store)
        secret = store_secret(topology.store)  # in the roles only: never logged, never in status
        self.colocated = topology.colocated is not None
        if topology.colocated is not None:  # one pool that prefills and decodes: held as `decode`
            c = topology.colocated
            engine = EngineConfig(
                page_size=c.page_size,
                num_pages=c.num_pages,
                max_num_seqs=c.max_num_seqs,
                max_num_batched_tokens=c.max_num_batched_tokens,
            )
            self.prefill: list[RankGroup] = []
            tiers = ColocatedRole(
                engine=engine, host_cache_pages=c.host_cache_pages, store=store, store_secret=secret
            )
            self.decode = groups("colocated", c, tiers)
            return
        p, d = topology.prefill, topology.decode
        self.prefill = groups(
            "prefill",
            p,
            PrefillRole(
                num_pages=p.num_pages,
                page_size=p.page_size,
                max_num_seqs=p.max_num_seqs,
                kv_timeout_s=topology.kv_timeout_s,
                max_num_batched_tokens=p.max_num_batched_tokens,
                layerwise=topology.kv_transfer == "layerwise",
                mtp=topology.speculative.tokens > 0 and topology.speculative.drafter == "mtp",
                max_jobs=p.max_jobs,
                host_cache_pages=p.host_cache_pages,
                store=store,
                store_secret=secret,
            ),
        )
        decode = DecodeRole(
            num_pages=d.num_pages,
            page_size=d.page_size,
            max_num_seqs=d.max_num_seqs,
            kv_timeout_s=topology.kv_timeout_s,
            speculative=topology.speculative.config(),
            store=store,
            store_secret=secret,
        )
        self.decode = groups("decode", d, decode)

    def _store_config(self, spec: StoreSpec | None) -> StoreConfig | None:
        """The ranks' store client settings; starts the deployment's own master if asked to.

        Mooncake's clients and master listen on every interface whatever they are told, so
        each rank starts with the bind guard preloaded and keeps its client's listeners on its
        node's address (``kvtransfer/mooncake_store.py``), as the master keeps its own on
        ``spec.host``. A node whose address is not loopback needs ``trusted_network``."""
        if spec is None:
            return None
        refuse_untrusted_nodes(spec)
        self._rank_env = tuple(preload_env(guard_library()).items())
        segment = spec.segment_mb << 20
        if spec.master is not None:
            host = spec.master.rsplit(":", 1)[0]
            metadata = spec.metadata or f"http://{host}:8080/metadata"
            trusted = spec.trusted_network
            return StoreConfig(spec.master, metadata, segment_bytes=segment, trusted_network=trusted)
        self.store_master = StoreMaster.start(spec.host)
        return StoreConfig(
            self.store_master.master,
            self.store_master.metadata,
            segment_bytes=segment,
            trusted_network=spec.trusted_network,
        )

    @property
    def groups(self) -> list[RankGroup]:
        return [*self.prefill, *self.decode]

    def start(self) -> None:
        """Start every group, side by side (the topology's ``start_concurrency`` at a time);
        if one fails, stop the others (their ranks and placement groups) before raising, so a
        failed start leaves nothing behind."""
        try:
            start_groups(self.groups, self.topology.start_concurrency)
            self._send_membership()
        except BaseException:
            for g in self.groups:
                g.stop()
            raise

    def _takes_work(self, g: RankGroup) -> bool:
        return self._state(g) is GroupState.READY and g.group_id not in self._draining

    def _state(self, g: RankGroup) -> GroupState:
        """A group added outside the lock is starting until it has joined the membership."""
        return GroupState.STARTING if g.group_id in self.starting else g.state

    def _send_membership(self) -> None:
        """Tell every live decode rank the prefill ranks that take jobs (ready, not draining);
        with ``kv_preconnect``, every rank also connects its transport to those of the other role
        (a rank already connected to a peer skips it)."""
        if self.colocated:
            return
        ranks: dict[RankId, Any] = {}
        for g in self.prefill:
            if self._takes_work(g):
                ranks |= g.actors
        decode = [a for g in self.decode if g.state is GroupState.READY for a in g.actors.values()]
        calls = [a.set_peers.remote(ranks) for a in decode]
        if self.topology.kv_preconnect:  # each side reaches the other's transports ahead of a transfer
            prefill_names = [r.name for r in ranks]
            decode_names = [r.name for g in self.decode if self._takes_work(g) for r in g.rank_ids]
            calls += [a.connect_peers.remote(prefill_names) for a in decode]
            calls += [
                a.connect_peers.remote(decode_names)
                for g in self.prefill
                if g.state is GroupState.READY
                for a in g.actors.values()
            ]
        ray.get(calls)

    def routing_view(self) -> RoutingView:
        def state(g: RankGroup) -> GroupState:
            draining = g.group_id in self._draining and g.state is GroupState.READY
            return GroupState.DRAINING if draining else self._state(g)

        live = [g for g in self.groups if self._takes_work(g)]
        views = tuple(
            GroupView(
                g.group_id,
                g.config.role.role,
                state(g),
                g.incarnation,
                tuple(g.rank_ids),
                tuple(g.places[r] for r in g.rank_ids if r in g.places),
                g.failure,
                g.unplaceable,
            )
            for g in self.groups
        )
        decode = {r: a for g in live if g in self.decode for r, a in g.actors.items()}
        p, d = self.topology.pools[0], self.topology.pools[-1]
        return RoutingView(
            # a colocated rank is both: the router picks it for the prompt and decodes there
            prefill=dict(decode)
            if self.colocated
            else {r: a for g in live if g in self.prefill for r, a in g.actors.items()},
            decode=decode,
            groups=views,
            page_size=p.page_size,
            prefill_capacity_tokens=p.num_pages * p.page_size,
            decode_capacity_tokens=d.num_pages * d.page_size,
            metrics_targets=tuple(self._rank_targets()),
            colocated=self.colocated,
        )

    def _rank_targets(self) -> list[ScrapeTarget]:
        out = []
        for g in self.groups:
            if self._state(g) is not GroupState.READY:
                continue
            for rank, address in g.metrics_addresses.items():
                labels = RankLabels(self.model_name, g.role, g.group_id, rank.name, str(g.incarnation))
                out.append(ScrapeTarget(address, "rank", labels.as_dict()))
        return out

    @property
    def draining(self) -> frozenset[str]:
        return frozenset(self._draining)

    def drain(self, group_id: str) -> None:
        """Stop sending a group new work; what it has runs to the end (a decode group's ranks
        refuse new requests, which their frontends route elsewhere)."""
        group = self.group(group_id)
        self._draining.add(group_id)
        self.on_draining_changed()
        self._send_membership()
        if group.state is GroupState.READY:
            ray.get([a.drain.remote() for a in group.actors.values()])

    def undrain(self, group_id: str) -> None:
        """Cancel a drain: the group takes new work again (its ranks accept requests, then the
        decode ranks hear of its prefill ranks; frontends route to it from the next view)."""
        group = self.group(group_id)
        self._draining.discard(group_id)
        self.on_draining_changed()
        if group.state is GroupState.READY:
            ray.get([a.undrain.remote() for a in group.actors.values()])
        self._send_membership()

    def restore_draining(self, group_ids: Iterable[str]) -> None:
        """After a controller restart, before ``adopt``: the groups that were draining (their
        ranks still refuse work; adopt's membership leaves them out)."""
        self._draining = set(group_ids)

    def forget_unknown_draining(self) -> list[str]:
        """After ``adopt``: drop draining ids of groups that are no longer there; those dropped."""
        known = {g.group_id for g in self.groups}
        gone = sorted(self._draining - known)
        self._draining &= known
        return gone

    def group(self, group_id: str) -> RankGroup:
        for g in self.groups:
            if g.group_id == group_id:
                return g
        raise ValueError(f"no group {group_id!r}; groups: {sorted(g.group_id for g in self.groups)}")

    def adopt(self) -> list[str]:
        """After a restart of the controller: take over every group whose ranks still run, found
        by their names in this deployment's namespace (the newest incarnation of each group;
        older leftovers are killed). A group of the topology with no rank left is marked
        failed, so the watch rebuilds it. Returns the ids adopted."""
        namespace = ray.get_runtime_context().namespace
        found: dict[str, dict[int, dict[int, str]]] = {}  # group -> incarnation -> rank -> name
        for entry in ray.util.list_named_actors(all_namespaces=True):
            parsed = parse_rank_actor_name(entry["name"]) if entry["namespace"] == namespace else None
            if parsed is not None:
                group_id, incarnation, rank = parsed
                found.setdefault(group_id, {}).setdefault(incarnation, {})[rank] = entry["name"]
        adopted = []
        for group_id, incarnations in sorted(found.items()):
            newest = max(incarnations)
            for incarnation, names in incarnations.items():
                if incarnation != newest:
                    for name in names.values():
                        with contextlib.suppress(ValueError, ray.exceptions.RayError):
                            ray.kill(ray.get_actor(name))
            group = self._group_for(group_id)
            if group is None:
                log.warning("controller restart: ranks of unknown group %s left alone", group_id)
                continue
            names = incarnations[newest]
            try:
                actors = [ray.get_actor(names[rank]) for rank in range(group.config.size)]
            except (KeyError, ValueError):  # a rank is gone: the group cannot be adopted
                for name in names.values():
                    with contextlib.suppress(ValueError, ray.exceptions.RayError):
                        ray.kill(ray.get_actor(name))
                group.incarnation, group.state = newest, GroupState.FAILED
                group.failure = "a rank was missing when the controller restarted"
                continue
            group.adopt(actors, newest)
            adopted.append(group_id)
        for group in self.groups:
            if group.state is GroupState.STOPPED:  # nothing of it ran: start it anew
                group.state, group.failure = GroupState.FAILED, "no rank found when the controller restarted"
        self._send_membership()
        return adopted

    def _group_for(self, group_id: str) -> RankGroup | None:
        """The topology's group of this id, or one the autoscaler had added (made again)."""
        for g in self.groups:
            if g.group_id == group_id:
                return g
        for role, template in self._templates.items():
            index = group_id.removeprefix(role.value)
            if index != group_id and index.isdigit():
                self._next_index[role] = max(self._next_index[role], int(index) + 1)
                group = RankGroup(replace(template, group_id=group_id))
                (self.prefill if role is Role.PREFILL else self.decode).append(group)
                return group
        return None

    def new_group(self, role: Role) -> RankGroup:
        """A group more for ``role``'s pool (named after the pool, never reusing a name), not
        started yet; ``Controller.add_group`` starts it."""
        if role not in self._templates:
            raise ValueError(f"role: expected prefill or decode, got {role!r}")
        index = self._next_index[role]
        self._next_index[role] = index + 1
        template = self._templates[role]
        per_rank, ordinal = self.topology.pin_cores_per_rank, self._next_ordinal
        self._next_ordinal += template.size
        cores = None if per_rank is None else (ordinal, per_rank)
        group = RankGroup(replace(template, group_id=f"{role.value}{index}", cores=cores))
        group.state = GroupState.STARTING  # shown as starting (a pending action) until it is ready
        (self.prefill if role is Role.PREFILL else self.decode).append(group)
        return group

    def joined(self, group: RankGroup) -> None:
        """A group ``new_group`` made has started (``Controller.add_group``) and takes work:
        the decode ranks hear of it."""
        self._send_membership()

    def idle(self, group: RankGroup) -> bool:
        """Whether the group's ranks hold no request, job or transfer."""
        return all(
            s.queued + s.running + s.waiting_for_kv + s.computing + s.transferring == 0
            and s.sends_in_flight + s.receives_in_flight == 0
            for s in group.stats()
        )

    def forget_group(self, group: RankGroup) -> None:
        """Stop a group and take it out of its pool (and of the membership)."""
        group.stop()
        for pool in (self.prefill, self.decode):
            if group in pool:
                pool.remove(group)
        self._draining.discard(group.group_id)
        self.on_draining_changed()
        self._send_membership()

    def taking_work(self, role: Role) -> list[RankGroup]:
        """The pool's groups that take work now (ready, joined, not draining)."""
        pool = self.prefill if role is Role.PREFILL else self.decode
        return [g for g in pool if self._takes_work(g)]

    def serving(self, role: Role) -> list[RankGroup]:
        """The pool's groups that take work, or will once started (not draining)."""
        pool = self.prefill if role is Role.PREFILL else self.decode
        return [g for g in pool if g.group_id not in self._draining]

    def watch(self) -> None:
        """Look at every group once: a rank that died, or whose loop failed, fails its group
        (its ranks killed and confirmed dead). Then, at once, the decode ranks get a
        membership without it, and every live rank of the other role hears that its ranks are
        lost: transfers with them fail now, and a decode rank retries its requests on the prefill
        ranks left, instead of waiting for a deadline."""
        failed = []
        for g in self.groups:
            was = g.state
            g.check()
            if was is GroupState.READY and g.state is GroupState.FAILED:
                failed.append(g)
        if not failed:
            return
        if any(g in self.prefill for g in failed):
            self._send_membership()
        for g in failed:
            if not g.dead:  # a rank Ray could not confirm gone: its peers keep their deadlines
                log.warning("group %s: not every rank was confirmed dead; no fence sent", g.group_id)
                continue
            lost = [r.name for r in g.rank_ids]
            peers = self.decode if g in self.prefill else self.prefill
            ray.get(
                [
                    a.peers_lost.remote(lost)
                    for p in peers
                    if p.state is GroupState.READY
                    for a in p.actors.values()
                ]
            )

    def heal(self, place_timeout_s: float = 10.0, retry_s: float = 5.0) -> list[str]:
        """Rebuild every failed group (gang restart) and resend the membership; the rebuilt ids.
        A rebuild waits ``place_timeout_s`` for its placement (a lost node's group may fit
        nowhere until the node returns): one that cannot be placed stays failed, saying why,
        and is tried again ``retry_s`` later."""
        rebuilt = []
        now = time.monotonic()
        for g in self.groups:
            if g.state is not GroupState.FAILED or now < self._retry_at.get(g.group_id, 0.0):
                continue
            if g.group_id in self.starting:  # its first start failed: that caller frees it
                continue
            try:
                g.restart(place_timeout_s)
            except GroupFailed as exc:
                log.warning("rebuilding %s: %s", g.group_id, exc)
                self._retry_at[g.group_id] = time.monotonic() + retry_s
                continue
            self._retry_at.pop(g.group_id, None)
            rebuilt.append(g.group_id)
        if rebuilt:
            self._send_membership()
        return rebuilt

    def stats(self) -> list[RankStats]:
        out: list[RankStats] = []
        for g in self.groups:
            if g.state is GroupState.READY:
                out.extend(g.stats())
        return out

    def check_integrity(self) -> None:
        for g in self.groups:
            if g.state is GroupState.READY:
                g.check_integrity()

    def status(self) -> dict[str, str]:
        return {v.group_id: f"{v.state} (incarnation {v.incarnation})" for v in self.routing_view().groups}

    def stop(self) -> None:
        for g in self.groups:
            g.stop()
        if self.store_master is not None:
            self.store_master.stop()


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
        self._removing: dict[str, Removal] = {}  # group id -> its removal under way
        self._drain_timeouts = {role.value: 0 for role in (Role.PREFILL, Role.DECODE)}  # by pool
        self._record = RecordStore(ray.get_runtime_context().namespace)
        self.cluster.on_draining_changed = self._save_record
        self._view = self._routing_view()
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
            self._removing = {r.group_id: r for r in record.removing if r.group_id in known}
            self._settings = record.autoscaler
            self._save_record()
            self._view = self._routing_view()
        log.warning(
            "controller restarted: adopted groups %s; draining %s; removing %s%s",
            ", ".join(adopted) or "none",
            ", ".join(sorted(self.cluster.draining)) or "none",
            ", ".join(sorted(self._removing)) or "none",
            f"; forgot draining groups no longer there: {', '.join(gone)}" if gone else "",
        )
        if record.autoscaler is not None:
            self._start_loop(record.autoscaler)
        for removal in list(self._removing.values()):
            self._resume_removal(removal)

    def _resume_removal(self, removal: Removal) -> None:
        group = self.cluster.group(removal.group_id)
        loop = self._autoscaler

        def step() -> str:
            self._await_removal(group, removal)
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

    def _save_record(self) -> None:
        """What a restarted controller resumes (``cluster/controller_state.py``); called with
        the lock held, whenever the settings, the draining set or the removals change."""
        draining = {*self.cluster.draining, *self._removing}
        removing = tuple(self._removing[g] for g in sorted(self._removing))
        self._record.save(ControllerRecord(self._settings, tuple(sorted(draining)), removing))

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
            self._view = self._routing_view()

    def unregister_frontend(self, name: str) -> None:
        with self._lock:
            self._frontends.pop(name, None)
            self._view = self._routing_view()

    def _autoscaler_figures(self) -> AutoscalerFigures | None:
        loop = self._autoscaler
        if loop is None:
            return None
        return replace(loop.figures(), drain_timeouts=dict(self._drain_timeouts))

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
            self._remove_group(newest, settings.drain_timeout_s, by_autoscaler=True)
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
        self._view = self._routing_view()
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
            self._view = self._routing_view()
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
                    self._view = self._routing_view()  # a failure shows before the rebuild
                with self._lock:
                    rebuilt = self.cluster.heal()
                    if rebuilt:
                        self.rebuilt += rebuilt
                        self._view = self._routing_view()
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
            self._view = self._routing_view()

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
            self._view = self._routing_view()
        try:
            group.start()
        except BaseException:
            with self._lock:
                self.cluster.starting.discard(group.group_id)
                self.cluster.forget_group(group)
                self._view = self._routing_view()
            raise
        with self._lock:
            self.cluster.starting.discard(group.group_id)
            if self._stop.is_set():  # stopped while this group started: it goes too
                self.cluster.forget_group(group)
                self._view = self._routing_view()
                raise RuntimeError(f"the controller stopped while {group.group_id} started")
            self.cluster.joined(group)
            self._view = self._routing_view()
        return group.group_id

    def remove_group(self, group_id: str, timeout_s: float = 300.0, quiet_s: float = 1.0) -> None:
        """Drain a group, wait until its ranks hold nothing for ``quiet_s`` (requests routed on a
        view just before the drain land first), then stop it and free its placement group. No
        request fails for it: a drained decode rank refuses new requests and their frontends
        route them elsewhere; a drained prefill group gets no new jobs. A group that still holds
        requests after ``timeout_s`` is not stopped: the drain is cancelled, the group takes work
        again and :class:`DrainTimeout` is raised."""
        self._remove_group(group_id, timeout_s, quiet_s)

    def _remove_group(
        self, group_id: str, timeout_s: float, quiet_s: float = 1.0, by_autoscaler: bool = False
    ) -> None:
        with self._lock:
            group = self.cluster.group(group_id)
            if group_id in self.cluster.starting:
                raise ValueError(f"{group_id} is still starting; remove it once it serves")
            if not [g for g in self.cluster.taking_work(group.config.role.role) if g is not group]:
                raise ValueError(f"{group_id} is the last group of its pool that takes work; add one first")
            removal = Removal(group_id, time.time(), timeout_s, by_autoscaler)
            self._removing[group_id] = removal
            try:
                self.cluster.drain(group_id)  # saves the record first: a restart resumes the removal
            except BaseException:
                self._removing.pop(group_id, None)
                self._save_record()  # still draining: the error says why
                raise
            finally:
                self._view = self._routing_view()
        self._await_removal(group, removal, quiet_s)

    def _await_removal(self, group: RankGroup, removal: Removal, quiet_s: float = 1.0) -> None:
        """Wait until the draining group is quiet, then stop it; at the removal's deadline,
        cancel the drain instead (:class:`DrainTimeout`). Returns early if the controller stops
        (it stops every group)."""
        quiet_since: float | None = None
        while True:
            if self._stop.is_set():
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
                self._cancel_removal(group, removal)
                raise DrainTimeout(group.group_id, time.time() - removal.started_unix_s)
            time.sleep(0.1)
        with self._lock:
            self.cluster.forget_group(group)
            self._removing.pop(group.group_id, None)
            self._save_record()
            self._view = self._routing_view()

    def _cancel_removal(self, group: RankGroup, removal: Removal) -> None:
        with self._lock:
            self._removing.pop(group.group_id, None)
            self._save_record()
            pool = group.config.role.role.value
            self._drain_timeouts[pool] = self._drain_timeouts.get(pool, 0) + 1
            try:
                if group in self.cluster.groups:
                    self.cluster.undrain(group.group_id)
            except ray.exceptions.RayError as exc:  # a rank died: the watch fails and rebuilds it
                log.warning("cancelling the drain of %s: %s", group.group_id, exc)
            self._view = self._routing_view()
        log.warning(
            "drain of %s cancelled: it still held requests after %.0f s; it takes work again",
            group.group_id,
            removal.timeout_s,
        )

    def stop(self) -> None:
        """Stop the autoscaler and every group; a clean stop leaves nothing to resume."""
        self._stop.set()
        if self._autoscaler is not None:
            self._autoscaler.stop()
        with self._lock:
            self._record.clear()
            self.cluster.stop()
            self._view = self._routing_view()
        if self._metrics is not None:
            self._metrics.close()
