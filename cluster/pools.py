"""A disaggregated cluster built from a topology: the prefill pool and the decode pool.

:class:`Cluster` starts every group, tells each decode rank the prefill ranks (membership), and
watches the groups: a failed group is rebuilt whole and the membership sent again. Groups are
added and removed at runtime (``add_group``, ``remove_group``): a removed group is drained
first, so no request fails for it. Requests do not pass through here: frontends route them to
ranks themselves, from the ``routing_view``. ``cluster/controller.py`` serves it as a named Ray
actor.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable
from typing import Any

import ray

from tandem.cluster.group import GroupFailed, RankGroup, parse_rank_actor_name, start_groups
from tandem.cluster.group_factory import GroupFactory
from tandem.cluster.kv_store_master import store_setup
from tandem.cluster.placement import RankResources
from tandem.cluster.pool_roles import pool_roles
from tandem.cluster.rank_spec import MetricsSpec
from tandem.cluster.store_secret import store_secret
from tandem.cluster.topology import Topology
from tandem.metrics.labels import RankLabels
from tandem.wire.messages import RankId, RankStats, Role
from tandem.wire.routing_view import GroupState, GroupView, RoutingView
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
        self._draining: set[str] = set()
        self.on_draining_changed: Callable[[], None] = lambda: None  # before ranks hear of it
        self._retry_at: dict[str, float] = {}  # failed group -> monotonic time of its next rebuild
        self.starting: set[str] = set()  # groups ``Controller.add_group`` starts outside the lock
        store, self.store_master, rank_env = store_setup(topology.store)
        secret = store_secret(topology.store)  # in the roles only: never logged, never in status
        self.colocated = topology.colocated is not None
        self._factory = GroupFactory(
            topology, model_dir, dtype, resources, metrics, detached, deployment, rank_env
        )
        self.prefill: list[RankGroup] = []
        self.decode: list[RankGroup] = []
        for name, pool, role in pool_roles(topology, store, secret):
            # a colocated pool prefills and decodes: held as `decode`
            (self.prefill if role.role is Role.PREFILL else self.decode).extend(
                self._factory.pool(name, pool, role)
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
        remade = self._factory.remade(group_id)
        if remade is None:
            return None
        role, group = remade
        (self.prefill if role is Role.PREFILL else self.decode).append(group)
        return group

    def new_group(self, role: Role) -> RankGroup:
        """A group more for ``role``'s pool (named after the pool, never reusing a name), not
        started yet; ``Controller.add_group`` starts it."""
        group = self._factory.new(role)
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
