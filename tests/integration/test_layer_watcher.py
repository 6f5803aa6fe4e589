"""The NIXL transport's watcher, between two real transports in one process (no Ray): a layer's
writes are posted the moment its ready event completes, with no call into the transport from the
caller's thread; an abort stops every layer whose event is still running; the compute figure
ends at the last layer's completion as the watcher saw it. With every event complete when handed
over (a CPU's), no thread starts and the figures are the caller's."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
import torch

from tandem.kvtransfer.metadata import InMemoryMetadataStore
from tandem.kvtransfer.nixl_transport import NixlTransport
from tandem.kvtransfer.transport import ReceivedKV, TransferFailure
from tandem.kvtransfer.types import (
    KVDestination,
    KVNotification,
    KVTransferAborted,
    SenderTimings,
    TransferStats,
)
from tandem.model.kv_pool import pool_layout
from tests.kvtransfer.transfer_doubles import CountingAgent, HeldEvent, HeldWrites, hold, wait_until

LAYERS, PAGES, PAGE_SIZE, DIM = 3, 16, 4, 8
SRC, DST = [5, 6, 9], [2, 3, 11]  # runs of one and two pages on each side


@dataclass
class _Pair:
    sender: NixlTransport
    receiver: NixlTransport
    src_pool: torch.Tensor
    dst_pool: torch.Tensor
    received: list[ReceivedKV] = field(default_factory=list)
    sent: list[TransferStats] = field(default_factory=list)
    failed: list[TransferFailure] = field(default_factory=list)

    def poll(self) -> None:
        """Both sides polled once, as their ranks' loops would."""
        for events in (self.receiver.poll(), self.sender.poll()):
            self.received += events.received
            self.sent += events.sent
            self.failed += events.failed

    def begin(self, request_id: str) -> None:
        self.receiver.expect(request_id, "prefill-0", DST, 30.0)
        self.sender.begin_send(request_id, KVDestination("decode-0", 1, tuple(DST)), SRC, 30.0)

    def pages_equal(self) -> bool:
        return torch.equal(self.dst_pool[:, DST], self.src_pool[:, SRC])


@pytest.fixture
def pair() -> Iterator[_Pair]:
    store = InMemoryMetadataStore()
    src_pool = torch.randn(LAYERS, PAGES, PAGE_SIZE, DIM, generator=torch.Generator().manual_seed(3))
    dst_pool = torch.zeros(LAYERS, PAGES, PAGE_SIZE, DIM)
    sides = _Pair(
        NixlTransport("prefill-0", 1, pool_layout(src_pool), store),
        NixlTransport("decode-0", 1, pool_layout(dst_pool), store),
        src_pool,
        dst_pool,
    )
    yield sides
    sides.sender.close()
    sides.receiver.close()


def _watchers() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("kv-watcher-")]


def test_a_layer_is_posted_as_its_event_completes_and_the_compute_figure_ends_at_the_last(
    pair: _Pair,
) -> None:
    """Three layers handed over with closed events. Opening layer 0's posts its write while layer
    1's stays unposted, with nothing called on the transport from this thread. The last layer's
    event is held back 0.3 s past ``finish_send``: no notification meanwhile; then the pages
    arrive byte for byte before the notification does, and the compute figure grows by the time
    the last layer's KV took past its queueing (the exposed figure starts after it)."""
    counter = CountingAgent(pair.sender.agent)
    pair.sender.agent = counter
    pair.begin("r")
    events = [HeldEvent() for _ in range(LAYERS)]
    for layer, event in enumerate(events):
        pair.sender.send_layer("r", layer, event)
    hold(0.2, lambda: counter.posted == 0)  # every event closed: nothing goes
    events[0].open()
    wait_until(lambda: counter.posted == 1)  # the watcher posted it: no call from here
    hold(0.2, lambda: counter.posted == 1)  # layer 1's event is closed: its write waits
    assert counter.posted_by == [f"kv-watcher-{pair.sender.agent_name}"]
    assert counter.posted_s[0] >= events[0].opened_s
    events[1].open()
    wait_until(lambda: counter.posted == 2)
    queued_s = time.monotonic()  # the host queued the last layer and sampled
    timings = SenderTimings(prefill_queue_s=0.5, prefill_compute_s=1.0)
    pair.sender.finish_send("r", KVNotification("r", 7, 0, timings), queued_s)
    held_s = 0.3
    hold(held_s, lambda: counter.posted == 2 and not pair.received and not pair.sent, pair.poll)
    events[2].open()
    wait_until(lambda: bool(pair.received), step=pair.poll)
    assert pair.pages_equal()  # the data was there when the notification was seen
    wait_until(lambda: bool(pair.sent), step=pair.poll)
    (got,), (sent,) = pair.received, pair.sent
    assert counter.posted == LAYERS and not pair.failed
    assert sent.compute_done_s >= events[2].opened_s >= queued_s + held_s
    figures = got.notification.timings
    assert figures.prefill_queue_s == 0.5
    assert figures.prefill_compute_s == pytest.approx(1.0 + sent.compute_done_s - queued_s)
    assert figures.prefill_compute_s >= 1.0 + held_s
    assert figures.kv_sender_exposed_s == pytest.approx(sent.notified_s - sent.compute_done_s)
    assert pair.sender.in_flight() == (0, 0) and pair.receiver.in_flight() == (0, 0)


def test_with_every_event_ready_no_thread_starts_and_the_figures_are_the_callers(pair: _Pair) -> None:
    """A CPU's forward: every layer is posted on the caller's thread as it is handed over, no
    watcher starts, and the compute figure and ``compute_done_s`` are the ones given."""
    counter = CountingAgent(pair.sender.agent)
    pair.sender.agent = counter
    pair.begin("r")
    for layer in range(LAYERS):
        pair.sender.send_layer("r", layer)
        assert counter.posted == layer + 1
    queued_s = time.monotonic()
    pair.sender.finish_send("r", KVNotification("r", 7, 0, SenderTimings(prefill_compute_s=1.0)), queued_s)
    wait_until(lambda: bool(pair.received and pair.sent), step=pair.poll)
    assert pair.pages_equal() and not _watchers()
    assert set(counter.posted_by) == {threading.current_thread().name}
    (got,), (sent,) = pair.received, pair.sent
    assert sent.compute_done_s == queued_s and got.notification.timings.prefill_compute_s == 1.0
    assert got.notification.timings.kv_sender_exposed_s == pytest.approx(sent.notified_s - queued_s)


@pytest.mark.parametrize("by", ["receiver", "sender"])
def test_an_abort_while_a_layers_event_runs_posts_nothing_of_it_and_waits_for_posted_writes(
    pair: _Pair, by: str
) -> None:
    """Layer 0 is posted (its write still landing, held by the agent), layers 1 and 2 still
    computing, when one side aborts. Their events then complete: nothing of them is ever posted,
    and neither side hears the end (the ABORT_ACK, or the sender's ABORT) until layer 0's write is
    over; then both report the failure and nothing is left in flight."""
    counter = CountingAgent(pair.sender.agent)
    held = HeldWrites(counter)
    pair.sender.agent = held
    pair.begin("r")
    events = [HeldEvent() for _ in range(LAYERS)]
    for layer, event in enumerate(events):
        pair.sender.send_layer("r", layer, event)
    events[0].open()
    wait_until(lambda: counter.posted == 1)
    if by == "receiver":
        pair.receiver.abort_receive("r")
        wait_until(lambda: "abort" in counter.received, step=pair.poll)  # the sender knows
    else:
        pair.sender.abort_send("r")
    events[1].open()
    events[2].open()  # the watcher wakes on each: the send is aborted, so it posts nothing
    hold(0.5, lambda: counter.posted == 1 and not pair.failed, pair.poll)
    assert pair.sender.in_flight() == (1, 0) and pair.receiver.in_flight() == (0, 1)
    held.release()  # layer 0's write is over
    wait_until(lambda: len(pair.failed) == 2, step=pair.poll)
    assert counter.posted == 1 and not pair.received and not pair.sent
    assert {f.role for f in pair.failed} == {"send", "recv"}
    assert all(isinstance(f.error, KVTransferAborted) for f in pair.failed)
    assert pair.sender.in_flight() == (0, 0) and pair.receiver.in_flight() == (0, 0)
