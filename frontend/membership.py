"""What a frontend knows of the deployment: the controller's view (the ranks that take work and
every group's state), each rank's incarnation, the router's ranks and loads, the KV event
subscriptions, and one submit channel to each decode rank.

``apply`` takes a new view (every ``refresh_s``); ``read_rank_stats`` feeds the router the
decode ranks' free pages and the prefill ranks' pending tokens, and names the decode ranks that
died. A rank is addressed by its ``RankId`` and the incarnation the view gave it: a channel of an
older incarnation is never used for a newer one.

Submits go over the decode rank's submit socket once it is open; until then (it opens in the
background on first sight of the rank) as an actor call. A rank that offers no socket takes
actor calls only.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import ray

from tandem.frontend.kv_event_feed import KVEventFeed
from tandem.frontend.rank_channel import RankChannel
from tandem.router.router import Router
from tandem.wire.messages import RankId, RankRequest, RankStats
from tandem.wire.routing_view import GroupState, RoutingView

log = logging.getLogger(__name__)


class Membership:
    def __init__(self, router: Router, kv_events: KVEventFeed, tasks: set[asyncio.Future[None]]) -> None:
        self.router, self.kv_events, self._tasks = router, kv_events, tasks
        self.view: RoutingView | None = None
        self.incarnations: dict[RankId, int] = {}  # rank -> incarnation in the current view
        self.states: dict[RankId, GroupState] = {}  # rank -> its group's state in the view
        self.rank_ids: dict[str, RankId] = {}  # the router's rank names -> the ranks
        # each decode rank's submit socket, by (rank, incarnation); those that offer none
        self._channels: dict[tuple[RankId, int], RankChannel] = {}
        self._no_channel: set[tuple[RankId, int]] = set()
        self._opening: set[tuple[RankId, int]] = set()
        self.submits = {"socket": 0, "actor": 0}  # submits made each way

    def apply(self, view: RoutingView) -> None:
        """Route over ``view`` from now on: its ranks, their KV subscriptions, their channels."""
        self.incarnations = {rank: g.incarnation for g in view.groups for rank in g.ranks}
        self.states = {rank: g.state for g in view.groups for rank in g.ranks}
        self.view = view
        self.rank_ids = {rank.name: rank for g in view.groups for rank in g.ranks}
        self.router.set_ranks(sorted(r.name for r in view.prefill), sorted(r.name for r in view.decode))
        self.kv_events.keep_only({r.name for r in view.prefill})
        for rank, handle in view.prefill.items():
            if self.kv_events.needs_subscription(rank.name, self.incarnations[rank]):
                self._spawn(self.kv_events.subscribe(rank.name, self.incarnations[rank], handle))
        self.keep_channels(view, self.incarnations)

    @property
    def ready(self) -> bool:
        """Both pools have a rank that takes work, and a prefill rank's index is loaded (routing
        to a prefill rank whose index is still loading costs cache hits, not tokens)."""
        view = self.view
        return (
            view is not None
            and bool(view.prefill)
            and bool(view.decode)
            and bool(self.kv_events.following.keys() & {r.name for r in view.prefill})
        )

    def gone(self, rank: RankId, incarnation: int) -> bool:
        """Whether a decode rank at ``incarnation`` went down: its group failed or stopped, or it
        was rebuilt under a new incarnation."""
        return self.states.get(rank) in (GroupState.FAILED, GroupState.STOPPED) or (
            self.incarnations.get(rank, incarnation) != incarnation
        )

    # ---- submits ------------------------------------------------------------------------------
    def submit(self, rank: RankId, incarnation: int, handle: Any, requests: list[RankRequest]) -> Any:
        """Send ``requests`` to a decode rank: over its submit socket once open, as an actor call
        until then; the awaitable of the rank's answer (``core.SUBMIT_ERRORS``)."""
        channel = self._channels.get((rank, incarnation))
        if channel is not None and channel.is_open:
            self.submits["socket"] += 1
            return channel.submit(requests)
        self.submits["actor"] += 1
        return handle.submit.remote(requests)

    def keep_channels(self, view: RoutingView, incarnations: dict[RankId, int]) -> None:
        """A submit socket to every decode rank of the view (opened in the background: until it
        is, submits are actor calls); those that ended are dropped, and those of ranks that left
        the view once no submit waits on them (a rank being drained answers its last submits
        with a refusal, and their requests are routed again)."""
        current = {(rank, incarnations[rank]) for rank in view.decode}
        for key, channel in list(self._channels.items()):
            if not channel.is_open or (key not in current and not channel.waiting):
                self._channels.pop(key).close()
        self._no_channel &= current
        for key in current - self._channels.keys() - self._no_channel - self._opening:
            handle = view.decode[key[0]]
            if not hasattr(handle, "submit_endpoint"):
                self._no_channel.add(key)
                continue
            self._opening.add(key)
            self._spawn(self._open_channel(key, handle))

    async def _open_channel(self, key: tuple[RankId, int], handle: Any) -> None:
        try:
            channel = await RankChannel.open(await handle.submit_endpoint.remote())
        except (ray.exceptions.RayError, OSError, TimeoutError, TypeError, ValueError) as exc:
            # no route to it: actor calls it is (a rank that failed is rebuilt with a new key)
            log.info("decode rank %s: submits stay actor calls: %s", key[0], exc)
            self._no_channel.add(key)
            return
        finally:
            self._opening.discard(key)
        if self.view is not None and key[0] in self.view.decode and self.incarnations.get(key[0]) == key[1]:
            self._channels[key] = channel
        else:  # the rank left the view meanwhile
            channel.close()

    def open_channels(self) -> int:
        return sum(channel.is_open for channel in self._channels.values())

    def close_channels(self) -> None:
        for channel in self._channels.values():
            channel.close()
        self._channels.clear()

    # ---- loads ----------------------------------------------------------------------------------
    async def read_rank_stats(self, view: RoutingView) -> list[RankId]:
        """Every rank's report: decode ranks' free pages and requests, prefill ranks' pending
        tokens (loads that include the other frontends' requests); the decode ranks that died."""
        handles = view.decode | view.prefill
        ranks = sorted(handles)
        replies = await asyncio.gather(*[handles[r].stats.remote() for r in ranks], return_exceptions=True)
        died = []
        for rank, stats in zip(ranks, replies, strict=True):
            if isinstance(stats, ray.exceptions.RayActorError) and rank in view.decode:
                died.append(rank)
            elif isinstance(stats, RankStats) and rank in view.decode:
                running = stats.running + stats.waiting_for_kv
                self.router.update_decode_stats(rank.name, stats.free_pages, running, stats.total_pages)
            elif isinstance(stats, RankStats):
                self.router.update_prefill_stats(rank.name, stats.pending_tokens)
        return died

    def _spawn(self, work: Any) -> None:
        """Run ``work`` in the background (a busy rank answers late), kept until it ends."""
        self._tasks.add(task := asyncio.ensure_future(work))
        task.add_done_callback(self._tasks.discard)
