"""The NIXL transport: UCX (RDMA on clusters; TCP or shared memory on one machine).

One agent per rank incarnation (``<rank>#<incarnation>``). The whole KV pool is registered once,
and one prepared descriptor list holds every (layer, page) of it; each peer incarnation's pool gets
a prepared list too, cached until the peer's incarnation changes. A transfer picks entries of the
two lists by index, run by run (:mod:`kvtransfer.descriptors`), so NIXL merges each run of
contiguous pages into one descriptor.

Ordering and timing: every layer's writes are posted as their own transfer (the last one too),
in layer order, each only once the ready event the sender handed over with it completes (on a GPU,
a CUDA event recorded after the layer's kernels: no write reads KV the device has not produced
yet). A layer handed over with ``READY`` (a CPU's forward) is posted at once on the caller's
thread, behind any layer still waiting. Any other event goes to the watcher
(:mod:`kvtransfer.event_watcher`), a thread of the transport's own that stamps each event's
completion and posts that send's ready layers, in order, while the forward is still running.
The last layer's stamp is when its KV was computed: the
sender's ``compute_done_s`` and the notification's ``prefill_compute_s`` end there, not at the
host's queueing of that layer (``finish_send``).

Once every transfer of the request is complete by NIXL's own account (its UCX backend flushes
the endpoint before it reports a transfer done, so the data is in the receiver's pool), the
sender stamps that moment and only then sends the notification, carrying the sender's figures:
first post -> last write completed (``kv_transfer_s``), last layer computed -> notification sent
(``kv_sender_exposed_s``) and the bytes the descriptors covered. The receiver never sees the
notification before the data, and the bill's transfer figures are the sender's own readings.

Threads: the caller's (every public method, the rank's loop) and the watcher share the sends, the
receives and the agent behind one lock, held for bookkeeping and NIXL calls (none of which waits),
never while waiting on an event. So the agent's calls never overlap (it runs unsynchronized, its
UCX workers in serialized mode; NIXL's progress thread, on for VRAM pools, is NIXL's own). A send's
error is set under the lock and a write is posted under it only while the send has none, so no
write is posted after an abort or a failure; the check that every posted write is over and the
ABORT/ABORT_ACK that follows it happen under the lock too.

Abort protocol (so no late write lands in a page that was handed out again)::

    receiver abort / deadline  ── ABORT(deadline) ──▶  sender stops posting, waits until every posted
                                                       write has completed or failed
                               ◀─ ABORT_ACK ─ only then; sender reports its failure (pages free)
    ... send not begun yet     ── ABORT(deadline) ──▶  ``poll`` reports it ``cancelled``: the caller
                                                       drops the job and calls ``confirm_cancelled``
                               ◀─ ABORT_ACK ─          (or drops it when it arrives, if it has not)
    receiver reports failure (pages free) on the ack, on a fence (the sender is dead), or once
    the job's own deadline has passed by ``abort_grace_s``: a prefill rank never begins a job
    past its deadline, so by then no write can come (the grace covers clocks that disagree)
    sender abort / deadline: posted writes drained, then ABORT ──▶ receiver reports failure

A cancellation the sender cannot match to a job yet is kept until the job's deadline, not in a
list of bounded length from which it could fall out.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

from tandem.kvtransfer.event_watcher import EventWatcher
from tandem.kvtransfer.metadata import MetadataStore
from tandem.kvtransfer.nixl_peers import NixlPeers
from tandem.kvtransfer.nixl_records import Layers, Recv, Send, parse_notification, seconds_until
from tandem.kvtransfer.nixl_writes import NixlWrites
from tandem.kvtransfer.regions import TransferLayout
from tandem.kvtransfer.transport import (
    KVTransport,
    ReceivedKV,
    TransferFailure,
    TransportEvents,
)
from tandem.kvtransfer.types import (
    ABORT,
    ABORT_ACK,
    DONE,
    READY,
    WARM,
    KVDestination,
    KVNotification,
    KVTransferAborted,
    KVTransferError,
    KVTransferTimeout,
    PeerLost,
    PoolLayout,
    RankMetadata,
    ReadyEvent,
    TransferStats,
    decode_message,
    encode_message,
    notification_fields,
)
from tandem.kvtransfer.ucx_config import configure_ucx

configure_ucx()  # before NIXL loads UCX: see kvtransfer/ucx_config.py

from nixl._api import nixl_agent, nixl_agent_config  # noqa: E402

_WATCHER_JOIN_S = 5.0  # how long ``close`` waits for the watcher to end


def progress_thread_enabled(mem_type: str) -> bool:
    """Whether the agent runs NIXL's progress thread. It polls its UCX worker without sleeping:
    a whole core per rank even when idle (0.8-1.0 of a core measured on CPU ranks). Without it a
    write completes when both sides' transports are polled (the sender's flush needs the
    receiver's answer), i.e. at the ranks' loop iterations: up to one decode step late. So: on
    for pools in GPU memory (GPU nodes have cores to spare, and a step can be long), off for
    pools in host memory (a CPU rank would give the thread a core its model needs);
    ``TANDEM_NIXL_PROGRESS_THREAD=1`` or ``0`` decides instead."""
    choice = os.environ.get("TANDEM_NIXL_PROGRESS_THREAD", "")
    if choice not in ("", "0", "1"):
        raise ValueError(f"TANDEM_NIXL_PROGRESS_THREAD: expected 0 or 1, got {choice!r}")
    return choice == "1" if choice else mem_type == "VRAM"


class NixlTransport(KVTransport):
    name = "nixl"
    layerwise = True

    def __init__(
        self,
        rank: str,
        incarnation: int,
        layout: PoolLayout | TransferLayout,
        store: MetadataStore,
        abort_grace_s: float = 5.0,
    ) -> None:
        if isinstance(layout, PoolLayout):
            layout = layout.as_transfer()
        self.rank, self.incarnation, self.layout, self.store = rank, incarnation, layout, store
        self.abort_grace_s = abort_grace_s
        self.agent_name = f"{rank}#{incarnation}"
        threads = int(os.environ.get("TANDEM_NIXL_THREADS", "0"))  # UCX worker threads; 0: NIXL's default
        progress_thread = progress_thread_enabled(layout.mem_type)
        config = nixl_agent_config(
            enable_prog_thread=progress_thread, backends=["UCX"], capture_telemetry=True, num_threads=threads
        )
        self._agent = agent = nixl_agent(self.agent_name, config)
        self._registration = agent.register_memory(layout.registrations(), layout.mem_type)
        local = agent.prep_xfer_dlist("NIXL_INIT_AGENT", layout.descs(), layout.mem_type)
        self._writes = NixlWrites(agent, local, layout)
        self._peers = NixlPeers(agent, store, layout)
        self._sends: dict[str, Send] = {}
        self._recvs: dict[str, Recv] = {}
        self.late_messages_dropped = 0
        self.warm_messages = 0  # peers that connected ahead of a transfer (``connect``)
        self.messages_undeliverable = 0
        self._ended: OrderedDict[str, None] = OrderedDict()  # recent sends, for late calls
        # receivers that gave up before this side began sending: id -> (their rank, agent, until)
        self._cancelled: dict[str, tuple[str, str, float]] = {}
        # guards everything above and the agent, between the caller's thread and the watcher
        self._lock = threading.RLock()
        self._watcher = EventWatcher(self._lock, f"kv-watcher-{self.agent_name}", self._layers_ready)
        store.publish(
            RankMetadata(rank, incarnation, self.agent_name, self.agent.get_agent_metadata(), layout)
        )

    @property
    def agent(self) -> Any:
        """The NIXL agent every part of the transport calls through. One object: a wrapper set
        here (one that delays or refuses writes, say) is the one the writes and peers use too."""
        return self._agent

    @agent.setter
    def agent(self, agent: Any) -> None:
        self._agent = self._writes.agent = self._peers.agent = agent

    # -- peers ---------------------------------------------------------------------------------
    def connect(self, ranks: Sequence[str]) -> list[str]:
        """Each peer's agent loaded and its pool's descriptors prepared now; then a WARM message
        to it, which makes UCX wire the endpoint up (its first use otherwise: 0.03-1 s of the
        first transfer's time, by transports and hosts)."""
        missed = []
        for rank in ranks:
            with self._lock:  # one peer at a time: the watcher may post between them
                if rank == self.rank or rank in self._peers:
                    continue
                try:
                    peer = self._peers.get(rank, None, "connect")
                except KVTransferError:  # not published yet, or an incompatible pool: the first transfer says
                    missed.append(rank)
                    continue
                self._message(peer.meta.agent_name, WARM, "")
        return missed

    def connected_peers(self) -> int:
        with self._lock:
            return len(self._peers)

    def _message(self, agent_name: str, kind: str, request_id: str, **fields: Any) -> None:
        """Send a control message, best effort: an agent that is gone, or was replaced by a newer
        incarnation and forgotten, cannot be told (and has nothing left to wait for)."""
        try:
            self.agent.send_notif(agent_name, encode_message(kind, request_id, self.rank, **fields))
        except Exception:
            self.messages_undeliverable += 1

    # -- sender --------------------------------------------------------------------------------
    def begin_send(
        self,
        request_id: str,
        dest: KVDestination,
        src_page_ids: Sequence[int],
        timeout_s: float,
        src_slot: int | None = None,
    ) -> None:
        with self._lock:
            if request_id in self._sends:
                raise KVTransferError(request_id, "a transfer with this request id is already in flight")
            if request_id in self._cancelled:  # the receiver gave up already: nothing may be written
                who = f"decode rank {self._cancelled[request_id][0]}"
                self.confirm_cancelled(request_id)
                raise KVTransferAborted(request_id, who)
            try:  # as many source pages as reserved, and a slot where the layout has slots
                runs = self.layout.runs(src_page_ids, dest.page_ids, src_slot, dest.state_slot)
            except ValueError as error:
                raise KVTransferError(request_id, str(error)) from None
            peer = self._peers.get(dest.rank, dest.incarnation, request_id)
            stats = TransferStats(request_id, dest.rank)
            self._sends[request_id] = Send(request_id, peer, runs, stats, time.monotonic() + timeout_s)

    def send_layer(self, request_id: str, layer: int, ready: ReadyEvent = READY) -> None:
        with self._lock:
            send = self._send(request_id)
            if send is None or send.error is not None or layer in send.layers_sent or send.whole:
                return
            send.layers_sent.add(layer)
            self._hand_over(send, [layer], ready)

    def send_all_layers(self, request_id: str) -> None:
        with self._lock:
            send = self._send(request_id)
            if send is not None:
                send.whole = True

    def finish_send(
        self,
        request_id: str,
        notification: KVNotification,
        compute_done_s: float,
        ready: ReadyEvent = READY,
    ) -> None:
        with self._lock:
            send = self._send(request_id)
            if send is None or send.error is not None:
                return
            send.notification = notification
            send.stats.compute_done_s = compute_done_s
            if send.whole:  # every layer in one transfer, now that all are queued
                layers = [layer for layer in range(self.layout.num_layers) if layer not in send.layers_sent]
                send.layers_sent.update(layers)
                self._hand_over(send, layers, ready)
            else:
                self._writes.post_ready(send)

    def is_cancelled(self, request_id: str) -> bool:
        with self._lock:
            return request_id in self._cancelled

    def confirm_cancelled(self, request_id: str) -> None:
        with self._lock:
            entry = self._cancelled.pop(request_id, None)
            if entry is None:
                return
            rank, agent_name, _ = entry
            with contextlib.suppress(KVTransferError):  # first contact: this side never wrote to it
                self._peers.get(rank, None, request_id)
            self._message(agent_name, ABORT_ACK, request_id)  # the job is dropped: pages may be freed

    def abort_send(self, request_id: str) -> None:
        with self._lock:
            send = self._sends.get(request_id)
            if send is not None and send.error is None:
                send.error = KVTransferAborted(request_id, f"prefill rank {self.rank}")

    def _send(self, request_id: str) -> Send | None:
        """The send in flight; ``None`` for one that already ended (aborted or timed out while
        its prefill kept computing), an error for one never begun."""
        send = self._sends.get(request_id)
        if send is None and request_id not in self._ended:
            raise KVTransferError(request_id, "no transfer was begun with this request id")
        return send

    def _hand_over(self, send: Send, layers: list[int], ready: ReadyEvent) -> None:
        """Queue ``layers`` behind the send's waiting ones; an event not complete yet goes to the
        watcher."""
        entry = Layers(layers, ready)
        send.waiting.append(entry)
        if ready is not READY:
            self._watcher.watch(send, entry)
        self._writes.post_ready(send)

    def _layers_ready(self, send: Send, entry: Layers, failure: Exception | None) -> None:
        """The watcher saw ``entry``'s event complete (or fail): post what is ready."""
        if failure is not None and send.error is None:
            send.error = KVTransferError(
                send.request_id, f"waiting for layers {entry.layers}: {type(failure).__name__}: {failure}"
            )
        self._writes.post_ready(send)

    def _progress_send(self, send: Send, now: float, events: TransportEvents) -> bool:
        """Advance one send; True when it is over (reported in ``events``)."""
        self._writes.post_ready(send)
        states = self._writes.states(send)
        if "ERR" in states and send.error is None:
            send.error = KVTransferError(send.request_id, f"a write to {send.peer.meta.rank} failed")
        if send.error is None and now > send.deadline:
            send.error = KVTransferTimeout(send.request_id, send.peer.meta.rank, now - send.stats.start_s)
        if send.error is not None:
            if "PROC" in states:
                return False  # a write is still landing in the receiver's pages: no word yet
            self._writes.release(send)
            # every posted write completed or failed: the receiver's pages may now be reused
            reply = ABORT_ACK if send.receiver_aborted else ABORT
            self._message(send.peer.meta.agent_name, reply, send.request_id)
            events.failed.append(TransferFailure(send.request_id, "send", send.error))
            return True
        if not send.all_posted(self.layout.num_layers) or any(state != "DONE" for state in states):
            return False
        send.stats.end_s = time.monotonic()  # the last write completed, as NIXL reports it
        send.stats.descriptors = self._writes.descriptors(send)
        self._writes.release(send)
        send.stats.notified_s = time.monotonic()  # sent now: what the receiver waits for
        fields = notification_fields(send.completed())
        try:
            self.agent.send_notif(
                send.peer.meta.agent_name, encode_message(DONE, send.request_id, self.rank, **fields)
            )
        except Exception as exc:  # the receiver's agent is gone: nothing waits for this KV
            send.error = KVTransferError(send.request_id, f"cannot notify {send.peer.meta.rank}: {exc}")
            return self._progress_send(send, now, events)
        events.sent.append(send.stats)
        return True

    # -- receiver ------------------------------------------------------------------------------
    def expect(self, request_id: str, peer_rank: str, page_ids: Sequence[int], timeout_s: float) -> None:
        with self._lock:
            if request_id in self._recvs:
                raise KVTransferError(request_id, "already expecting a transfer with this request id")
            now = time.monotonic()
            self._recvs[request_id] = Recv(request_id, peer_rank, tuple(page_ids), now, now + timeout_s)

    def abort_receive(self, request_id: str) -> None:
        with self._lock:
            recv = self._recvs.get(request_id)
            if recv is not None and recv.error is None:
                self._start_abort(
                    recv, KVTransferAborted(request_id, f"decode rank {self.rank}"), time.monotonic()
                )

    def _start_abort(self, recv: Recv, error: KVTransferError, now: float) -> None:
        # without an ack, the pages are safe once the job's deadline is past (see above)
        recv.error, recv.ack_deadline = error, max(now, recv.deadline) + self.abort_grace_s
        try:
            peer = self._peers.get(recv.peer_rank, None, recv.request_id)
        except KVTransferError:
            recv.ack_deadline = now  # no such peer: nothing can write into the pages
            return
        deadline_unix_s = time.time() + (recv.deadline - now)
        self._message(peer.meta.agent_name, ABORT, recv.request_id, deadline_unix_s=deadline_unix_s)

    # -- both ----------------------------------------------------------------------------------
    def fence_peer(self, rank: str) -> None:
        with self._lock:
            for recv in self._recvs.values():
                if recv.peer_rank == rank:
                    recv.error, recv.ack_deadline = PeerLost(recv.request_id, rank), 0.0  # fail now
            for send in self._sends.values():
                if send.peer.meta.rank == rank and send.error is None:
                    send.error = PeerLost(send.request_id, rank)  # drained, then failed
            self._peers.forget(rank)

    def poll(self) -> TransportEvents:
        with self._lock:
            return self._poll()

    def _poll(self) -> TransportEvents:
        events = TransportEvents()
        now = time.monotonic()
        for agent_name, messages in self.agent.get_new_notifs().items():
            for raw in messages:
                self._on_message(agent_name, raw, now, events)
        for request_id in [r for r, s in self._sends.items() if self._progress_send(s, now, events)]:
            del self._sends[request_id]
            self._ended[request_id] = None
            if len(self._ended) > 4096:
                self._ended.popitem(last=False)
        for request_id in [r for r, (*_, until) in self._cancelled.items() if now >= until]:
            del self._cancelled[request_id]  # its job can no longer begin: nothing to refuse
        for recv in list(self._recvs.values()):
            if recv.error is None and now > recv.deadline:
                self._start_abort(
                    recv, KVTransferTimeout(recv.request_id, recv.peer_rank, now - recv.start), now
                )
            if recv.error is not None and now >= recv.ack_deadline:
                self._fail_recv(recv, events)
        return events

    def _on_message(self, agent_name: str, raw: bytes, now: float, events: TransportEvents) -> None:
        msg = decode_message(raw)
        if msg is None:
            self.late_messages_dropped += 1
            return
        kind, request_id = msg["kind"], msg["request_id"]
        if kind == WARM:  # a peer connecting ahead of its first transfer: nothing to do
            self.warm_messages += 1
            return
        if kind == ABORT and request_id in self._sends:  # the receiver gave up: stop, drain, ack
            send = self._sends[request_id]
            if send.error is None:
                send.error = KVTransferAborted(request_id, f"decode rank {msg['sender']}")
            send.receiver_aborted = True  # acked by ``_progress_send`` once no write is in flight
            return
        if kind == ABORT and request_id not in self._recvs:  # nothing in flight here to stop
            if request_id in self._ended:  # over already: nothing more will be written
                self._message(agent_name, ABORT_ACK, request_id)
                return
            # not begun: acked once the caller has dropped the job (or on its arrival, refused)
            until = now + seconds_until(msg.get("deadline_unix_s"), self.abort_grace_s)
            self._cancelled[request_id] = (str(msg["sender"]), agent_name, until)
            events.cancelled.append(request_id)
            return
        recv = self._recvs.get(request_id)
        if recv is None:
            self.late_messages_dropped += 1  # a notification for a request already aborted
            return
        if kind == DONE and recv.error is None:
            notification = parse_notification(request_id, msg)
            if notification is None:  # sent after its writes: the pages are safe to give up
                recv.error = KVTransferError(request_id, f"malformed notification from {recv.peer_rank}")
                self._fail_recv(recv, events)
                return
            stats = TransferStats(request_id, recv.peer_rank, start_s=recv.start, end_s=now)
            stats.bytes = notification.kv_bytes  # what the sender's descriptors covered
            stats.layers_written = self.layout.num_layers
            del self._recvs[request_id]
            events.received.append(ReceivedKV(notification, stats))
        elif kind in (DONE, ABORT_ACK):  # every write is over: the abort can complete
            self._fail_recv(recv, events)
        elif kind == ABORT:  # the sender gave up after draining its writes
            recv.error = recv.error or KVTransferAborted(request_id, f"prefill rank {msg['sender']}")
            self._fail_recv(recv, events)

    def _fail_recv(self, recv: Recv, events: TransportEvents) -> None:
        assert recv.error is not None
        self._recvs.pop(recv.request_id, None)
        events.failed.append(TransferFailure(recv.request_id, "recv", recv.error))

    def in_flight(self) -> tuple[int, int]:
        with self._lock:
            return len(self._sends), len(self._recvs)

    def close(self) -> None:
        """Stop the watcher (``EventWatcher.close``), then drop every transfer and the pool's
        registration."""
        self._watcher.close(_WATCHER_JOIN_S)
        with self._lock:
            for send in self._sends.values():
                self._writes.release(send)
            self._sends.clear()
            self._recvs.clear()
            self.agent.deregister_memory(self._registration)
