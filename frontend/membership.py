"""What a frontend knows of the deployment: the controller's view (the ranks that take work and
every group's state), each rank's incarnation, the router's ranks and loads, the KV event
subscriptions, and one channel to each rank of the view.

``apply`` takes a new view (every ``refresh_s``); ``read_rank_stats`` feeds the router the
decode ranks' free pages and the prefill ranks' pending tokens, and names the decode ranks that
died. A rank is addressed by its ``RankId`` and the incarnation the view gave it: a channel of an
older incarnation is never used for a newer one.

Requests, aborts, the rank's streams back and a prefill rank's KV events all go over the
channel (``wire/channel.py``), opened in the background on first sight of the rank and again at
each view until it opens; a prefill rank is subscribed to once its channel is open.
The router is offered only the decode ranks whose channel is open; a submit that finds none
(it closed since the route was chosen) raises ``RankNotReachable``, and the request is routed
again. A channel stays open while its rank's group is in the view and neither failed nor
stopped (a group being drained still streams its requests' tokens); when it ends while in use,
``on_lost`` hears which rank and why (the requests there move: their tokens would come on it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

import ray

from tandem.frontend.kv_event_feed import KVEventFeed
from tandem.frontend.rank_channel import RankChannel, RankNotReachable
from tandem.router.router import Router
from tandem.wire.messages import RankId, RankRequest, RankStats, StreamBatch
from tandem.wire.routing_view import GroupState, RoutingView

log = logging.getLogger(__name__)

ChannelKey = tuple[RankId, int]  # a rank and its incarnation


class Membership:
    def __init__(
        self,
        router: Router[RankId],
        kv_events: KVEventFeed,
        tasks: set[asyncio.Future[None]],
        frontend: str = "",
        on_batch: Callable[[StreamBatch], None] = lambda batch: None,
        on_lost: Callable[[RankId, int, str], None] = lambda rank, incarnation, why: None,
    ) -> None:
        self.router, self.kv_events, self._tasks = router, kv_events, tasks
        self.frontend, self.on_batch, self.on_lost = frontend, on_batch, on_lost
        self.view: RoutingView | None = None
        self.incarnations: dict[RankId, int] = {}  # rank -> incarnation in the current view
        self.states: dict[RankId, GroupState] = {}  # rank -> its group's state in the view
        self.channels: dict[ChannelKey, RankChannel] = {}  # open, by (rank, incarnation)
        self._opening: set[ChannelKey] = set()
        self.submits = {"channel": 0, "unreachable": 0}  # submits sent; refused for no channel

    def apply(self, view: RoutingView) -> None:
        """Route over ``view`` from now on: its ranks, their KV subscriptions, their channels."""
        self.incarnations = {rank: g.incarnation for g in view.groups for rank in g.ranks}
        self.states = {rank: g.state for g in view.groups for rank in g.ranks}
        self.view = view
        self.kv_events.keep_only(set(view.prefill))
        self.keep_channels(view)
        for rank in view.prefill:
            self._follow(rank)
        self.route_over(view)

    def _follow(self, rank: RankId) -> None:
        """Subscribe to a prefill rank's KV events on its channel, unless following them."""
        incarnation = self.incarnations.get(rank, -1)
        channel = self.channels.get((rank, incarnation))
        if channel is not None and channel.is_open and self.kv_events.needs_subscription(rank, incarnation):
            self._spawn(self.kv_events.subscribe(rank, incarnation, channel))

    def route_over(self, view: RoutingView) -> None:
        """Offer the router the view's prefill ranks and its decode ranks that are reachable (a
        colocated rank is both: it is offered once reachable)."""
        decode = sorted(r for r in view.decode if self.reachable(r))
        prefill = decode if view.colocated else sorted(view.prefill)
        self.router.set_ranks(prefill, decode)

    def reachable(self, rank: RankId) -> bool:
        """Whether a channel to the rank's current incarnation is open."""
        channel = self.channels.get((rank, self.incarnations.get(rank, -1)))
        return channel is not None and channel.is_open

    @property
    def ready(self) -> bool:
        """Both pools have a rank that takes work, a decode rank is reachable, and a prefill
        rank's index is loaded (routing to a prefill rank whose index is still loading costs
        cache hits, not tokens)."""
        view = self.view
        return (
            view is not None
            and bool(view.prefill)
            and any(self.reachable(r) for r in view.decode)
            and bool(self.kv_events.following.keys() & view.prefill.keys())
        )

    def gone(self, rank: RankId, incarnation: int) -> bool:
        """Whether a decode rank at ``incarnation`` went down: its group failed or stopped, or it
        was rebuilt under a new incarnation."""
        return self.states.get(rank) in (GroupState.FAILED, GroupState.STOPPED) or (
            self.incarnations.get(rank, incarnation) != incarnation
        )

    # ---- channels -----------------------------------------------------------------------------
    def channel(self, rank: RankId, incarnation: int) -> RankChannel:
        """The open channel to the rank at ``incarnation``; ``RankNotReachable`` when none is."""
        channel = self.channels.get((rank, incarnation))
        if channel is None or not channel.is_open:
            self.submits["unreachable"] += 1
            raise RankNotReachable(rank)
        return channel

    def submit(self, channel: RankChannel, requests: list[RankRequest]) -> asyncio.Future[None]:
        """Send ``requests`` on a rank's channel; the future of its answer (``SUBMIT_ERRORS``)."""
        self.submits["channel"] += 1
        return channel.submit(requests)

    def abort(self, rank: RankId, request_ids: list[str]) -> None:
        """Tell a rank to abort requests; nothing when no channel to it is open (the rank ends
        what it holds for this frontend when its channel ends)."""
        channel = self.channels.get((rank, self.incarnations.get(rank, -1)))
        if channel is not None:
            channel.abort(request_ids)

    def keep_channels(self, view: RoutingView) -> None:
        """A channel to every rank of the view that takes work (opened in the background; until
        it is, the router is not offered a decode rank, and a prefill rank's events are not
        followed); channels that ended, or whose rank's group left the view, failed, stopped or
        was rebuilt, are closed."""
        live = {
            (rank, g.incarnation)
            for g in view.groups
            if g.state not in (GroupState.FAILED, GroupState.STOPPED)
            for rank in g.ranks
        }
        for key, channel in list(self.channels.items()):
            if not channel.is_open or key not in live:
                self.channels.pop(key).close()
        for rank, handle in (view.prefill | view.decode).items():
            key = (rank, self.incarnations[rank])
            if key not in self.channels and key not in self._opening:
                self._opening.add(key)
                self._spawn(self._open_channel(key, handle))

    async def _open_channel(self, key: ChannelKey, handle: Any) -> None:
        rank, incarnation = key
        try:
            endpoint = await handle.channel_endpoint.remote()
            channel = await RankChannel.open(
                endpoint,
                self.frontend,
                self.on_batch,
                lambda why: self._ended(key, channel, why),
                self.kv_events.on_batch,
            )
        except (ray.exceptions.RayError, OSError, TimeoutError, TypeError, ValueError, AttributeError) as exc:
            # tried again at the next view (a rank that failed is rebuilt with a new key)
            log.info("rank %s: no channel yet: %s", rank, exc)
            return
        finally:
            self._opening.discard(key)
        view = self.view
        takes_work = view is not None and (rank in view.decode or rank in view.prefill)
        if view is not None and takes_work and self.incarnations.get(rank) == incarnation:
            self.channels[key] = channel
            self.route_over(view)
            if rank in view.prefill:
                self._follow(rank)
        else:  # the rank left the view meanwhile
            channel.close()

    def _ended(self, key: ChannelKey, channel: RankChannel, why: str) -> None:
        """A channel ended from the rank's side: its rank is no longer offered to the router,
        and what ran there moves (``on_lost``)."""
        if self.channels.get(key) is channel:
            del self.channels[key]
        if self.kv_events.following.get(key[0]) == key[1]:
            self.kv_events.forget(key[0])  # followed again on its next channel
        if self.view is not None:
            self.route_over(self.view)
        log.warning("the channel to rank %s ended: %s", key[0], why)
        self.on_lost(key[0], key[1], why)

    def open_channels(self) -> int:
        return sum(channel.is_open for channel in self.channels.values())

    def close_channels(self) -> None:
        for channel in self.channels.values():
            channel.close()
        self.channels.clear()

    # ---- loads ----------------------------------------------------------------------------------
    async def read_rank_stats(self, view: RoutingView) -> list[RankId]:
        """Every rank's report: decode ranks' free pages and requests, prefill ranks' pending
        tokens (loads that include the other frontends' requests) and the measured prices of
        their KV tiers; the decode ranks that died."""
        handles = view.decode | view.prefill
        ranks = sorted(handles)
        replies = await asyncio.gather(*[handles[r].stats.remote() for r in ranks], return_exceptions=True)
        died = []
        for rank, stats in zip(ranks, replies, strict=True):
            if isinstance(stats, ray.exceptions.RayActorError) and rank in view.decode:
                died.append(rank)
            elif isinstance(stats, RankStats) and rank in view.decode:
                running = stats.running + stats.waiting_for_kv
                self.router.update_decode_stats(rank, stats.free_pages, running, stats.total_pages)
            elif isinstance(stats, RankStats):
                self.router.update_prefill_stats(rank, stats.pending_tokens)
                tiers = stats.tiers
                if tiers.kv_bytes_per_token:  # the rank's measured prices of its tiers
                    self.router.set_tier_speeds(
                        rank,
                        tiers.host_bytes_per_s,
                        tiers.store_bytes_per_s,
                        tiers.prefill_tokens_per_s,
                        tiers.kv_bytes_per_token,
                    )
        return died

    def _spawn(self, work: Any) -> None:
        """Run ``work`` in the background (a busy rank answers late), kept until it ends."""
        self._tasks.add(task := asyncio.ensure_future(work))
        task.add_done_callback(self._tasks.discard)
