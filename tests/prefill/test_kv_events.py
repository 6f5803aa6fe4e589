"""A prefill rank's KV events for subscribers: snapshot first, then numbered batches."""

from __future__ import annotations

from tandem.engine.kv_event_publisher import KVEventPublisher
from tandem.wire.kv_events import AllBlocksCleared, BlockRemoved, BlockStored
from tandem.wire.messages import RankId


def test_snapshot_then_numbered_batches_per_subscriber() -> None:
    publisher = KVEventPublisher(RankId("prefill0", 1), page_size=8)
    assert publisher.publish([BlockRemoved((1,))]) == {}  # nobody listens yet
    snapshot = publisher.subscribe("frontend-a", [11, 12])
    assert (snapshot.rank, snapshot.seq, snapshot.reset) == (RankId("prefill0", 1), 0, True)
    assert snapshot.events == [AllBlocksCleared(), BlockStored((11, 12), None, 8)]
    stored = BlockStored((13,), 12, 8)
    batches = publisher.publish([stored])
    assert batches["frontend-a"].seq == 1 and batches["frontend-a"].events == [stored]
    publisher.subscribe("frontend-b", [11, 12, 13])
    batches = publisher.publish([BlockRemoved((11,))])
    assert {name: b.seq for name, b in batches.items()} == {"frontend-a": 2, "frontend-b": 1}
    assert publisher.publish([]) == {}
    publisher.unsubscribe("frontend-a")
    assert publisher.subscribers == ["frontend-b"]
    again = publisher.subscribe("frontend-b", [])  # a resubscription starts over from a snapshot
    assert again.seq == 0 and again.events == [AllBlocksCleared()]
    assert publisher.publish([BlockRemoved((12,))])["frontend-b"].seq == 1
