"""NIXL KV transfers between two Ray actors (separate processes) on loopback."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray

from tandem.bench.kv_peer import KVPeer, PeerEvents
from tandem.cluster.ray_bootstrap import init_ray, shutdown_ray
from tandem.kvtransfer.descriptors import page_runs
from tandem.kvtransfer.types import KVDestination, KVTransferAborted, KVTransferTimeout, StalePeerError

LAYERS, PAGES, PAGE_SIZE, DIM = 3, 48, 16, 40


def _peer(rank: str, incarnation: int = 1) -> Any:
    return KVPeer.remote(rank, incarnation, LAYERS, PAGES, PAGE_SIZE, DIM)  # type: ignore[attr-defined]


@pytest.fixture(scope="module")
def peers() -> Iterator[tuple[Any, Any]]:
    init_ray()
    prefill, decode = _peer("prefill-0"), _peer("decode-0")
    ray.get([prefill.check.remote(), decode.check.remote()])
    yield prefill, decode
    shutdown_ray()


def _settle(
    prefill: Any, decode: Any, request_ids: set[str], timeout_s: float = 20.0
) -> tuple[PeerEvents, PeerEvents]:
    """Poll both sides (as their step loops would) until each request has an event on each side."""
    sides = (PeerEvents(), PeerEvents())
    deadline = time.monotonic() + timeout_s

    def missing(events: PeerEvents) -> set[str]:
        return request_ids - (events.received.keys() | events.sent.keys() | events.failed.keys())

    while missing(sides[0]) or missing(sides[1]):
        assert time.monotonic() < deadline, f"no event for {request_ids} within {timeout_s}s"
        for total, got in zip(
            sides, ray.get([prefill.poll.remote(0.05), decode.poll.remote(0.05)]), strict=True
        ):
            total.received |= got.received
            total.received_stats |= got.received_stats
            total.sent |= got.sent
            total.failed |= got.failed
    return sides


def _all_pages_free(*actors: Any) -> None:
    ray.get([a.free_unheld.remote() for a in actors])
    for free, in_flight in ray.get([a.check.remote() for a in actors]):
        assert (free, in_flight) == (PAGES, 0)


def _prepare(prefill: Any, decode: Any, rid: str, pages: int, seed: int) -> tuple[list[int], list[int]]:
    """Random source pages in a shuffled order, and non-contiguous reserved destination pages."""
    src = random.Random(seed).sample(ray.get(prefill.allocate.remote(pages + 3)), pages)
    ray.get(prefill.fill.remote(src, seed))
    dst = ray.get(decode.allocate.remote(2 * pages))[::2]
    ray.get(decode.expect.remote(rid, "prefill-0", dst, 10.0))
    return src, dst


@pytest.mark.parametrize("layerwise", [True, False], ids=["layerwise", "whole-request"])
def test_pages_arrive_byte_for_byte(peers: tuple[Any, Any], layerwise: bool) -> None:
    prefill, decode = peers
    for i, tokens in enumerate([1, PAGE_SIZE + 5, 9 * PAGE_SIZE + 3]):  # 1 token, partial page, many pages
        rid, pages = f"{layerwise}-{i}", -(-tokens // PAGE_SIZE)
        src, dst = _prepare(prefill, decode, rid, pages, seed=i)
        ray.get(prefill.send.remote(rid, KVDestination("decode-0", 1, tuple(dst)), src, layerwise, 10.0))
        sent, got = _settle(prefill, decode, {rid})
        assert got.received[rid].first_token == 7
        assert ray.get(decode.read.remote(dst)) == ray.get(prefill.read.remote(src))
        stats = sent.sent[rid]
        assert stats.bytes == pages * LAYERS * PAGE_SIZE * DIM * 4 == got.received_stats[rid].bytes
        assert stats.layers_written == LAYERS and stats.gb_s > 0
        # one descriptor per run of pages contiguous on both sides, per layer
        assert stats.descriptors == len(page_runs(src, dst)) * LAYERS
    _all_pages_free(prefill, decode)


def test_contiguous_pages_coalesce_into_one_descriptor_per_layer(peers: tuple[Any, Any]) -> None:
    prefill, decode = peers
    src, dst = list(range(10, 16)), list(range(30, 36))
    for actor, keep in ((prefill, src), (decode, dst)):
        every = ray.get(actor.allocate.remote(PAGES))
        ray.get(actor.free.remote([p for p in every if p not in keep]))
    ray.get(decode.expect.remote("runs", "prefill-0", dst, 10.0))
    ray.get(prefill.send.remote("runs", KVDestination("decode-0", 1, tuple(dst)), src, True, 10.0))
    sent, _ = _settle(prefill, decode, {"runs"})
    assert sent.sent["runs"].descriptors == LAYERS
    _all_pages_free(prefill, decode)


def test_receiver_abort_mid_transfer(peers: tuple[Any, Any]) -> None:
    prefill, decode = peers
    src, dst = _prepare(prefill, decode, "ra", 4, seed=11)
    ray.get(prefill.begin_send.remote("ra", KVDestination("decode-0", 1, tuple(dst)), src, 10.0))
    ray.get(prefill.send_layers.remote("ra", [0]))  # layer 0 written, the rest not computed yet
    ray.get(decode.abort_receive.remote("ra"))
    # the sender learns, drains its writes and acknowledges; the receiver frees its pages on the ack
    sender, receiver = _settle(prefill, decode, {"ra"})
    assert isinstance(sender.failed["ra"].error, KVTransferAborted)
    assert isinstance(receiver.failed["ra"].error, KVTransferAborted) and "decode" in str(
        receiver.failed["ra"].error
    )
    ray.get(prefill.send_layers.remote("ra", [1, 2]))  # a late step of the prefill rank is harmless
    _all_pages_free(prefill, decode)


def test_abort_after_the_data_landed_drops_the_late_notification(peers: tuple[Any, Any]) -> None:
    prefill, decode = peers
    src, dst = _prepare(prefill, decode, "late-done", 2, seed=13)
    ray.get(prefill.send.remote("late-done", KVDestination("decode-0", 1, tuple(dst)), src, False, 10.0))
    deadline = time.monotonic() + 20
    # the receiver's polls make its worker progress (the writes complete only then, with no
    # progress thread); DONE is sent by the sender's poll that sees them complete, after which
    # the receiver polls no more
    while True:
        assert time.monotonic() < deadline
        early = ray.get(decode.poll.remote(0.0))
        assert not early.received and not early.failed
        if "late-done" in ray.get(prefill.poll.remote(0.05)).sent:  # DONE is on its way
            break
    dropped = ray.get(decode.late_messages_dropped.remote())
    ray.get(decode.abort_receive.remote("late-done"))  # the decode rank gives up before it polled
    receiver = PeerEvents()
    while not receiver.failed:
        assert time.monotonic() < deadline and not receiver.received
        _, got = ray.get([prefill.poll.remote(0.05), decode.poll.remote(0.05)])
        receiver.received |= got.received
        receiver.failed |= got.failed
    assert isinstance(receiver.failed["late-done"].error, KVTransferAborted)
    deadline = time.monotonic() + 5
    while ray.get(decode.late_messages_dropped.remote()) == dropped:  # the sender's ack comes too late
        assert time.monotonic() < deadline
        ray.get([prefill.poll.remote(0.05), decode.poll.remote(0.05)])
    _all_pages_free(prefill, decode)


def test_sender_abort_mid_transfer(peers: tuple[Any, Any]) -> None:
    prefill, decode = peers
    src, dst = _prepare(prefill, decode, "sa", 4, seed=12)
    ray.get(prefill.begin_send.remote("sa", KVDestination("decode-0", 1, tuple(dst)), src, 10.0))
    ray.get(prefill.send_layers.remote("sa", [0, 1]))
    ray.get(prefill.abort_send.remote("sa"))
    sender, receiver = _settle(prefill, decode, {"sa"})
    assert isinstance(sender.failed["sa"].error, KVTransferAborted)
    error = receiver.failed["sa"].error
    assert isinstance(error, KVTransferAborted) and "prefill" in str(error)
    _all_pages_free(prefill, decode)


def test_deadline_expires_on_both_sides(peers: tuple[Any, Any]) -> None:
    prefill, decode = peers
    src = ray.get(prefill.allocate.remote(2))
    dst = ray.get(decode.allocate.remote(2))
    ray.get(decode.expect.remote("late", "prefill-0", dst, 0.5))
    ray.get(prefill.begin_send.remote("late", KVDestination("decode-0", 1, tuple(dst)), src, 0.5))
    ray.get(prefill.send_layers.remote("late", [0]))  # and then the prefill rank stalls
    start = time.monotonic()
    sender, receiver = _settle(prefill, decode, {"late"})
    assert time.monotonic() - start < 10
    assert isinstance(receiver.failed["late"].error, KVTransferTimeout)
    assert isinstance(sender.failed["late"].error, (KVTransferTimeout, KVTransferAborted))
    _all_pages_free(prefill, decode)


def test_restarted_peer_is_refused_until_its_new_metadata_is_published(peers: tuple[Any, Any]) -> None:
    prefill, decode = peers
    src = ray.get(prefill.allocate.remote(2))
    ray.get(prefill.fill.remote(src, 5))
    ray.kill(decode)
    with pytest.raises(StalePeerError, match="incarnation 2"):
        ray.get(prefill.begin_send.remote("new", KVDestination("decode-0", 2, (0, 1)), src, 5.0))
    decode2 = _peer("decode-0", incarnation=2)
    dst = ray.get(decode2.allocate.remote(2))
    ray.get(decode2.expect.remote("new", "prefill-0", dst, 10.0))
    ray.get(prefill.send.remote("new", KVDestination("decode-0", 2, tuple(dst)), src, True, 10.0))
    _settle(prefill, decode2, {"new"})
    assert ray.get(decode2.read.remote(dst)) == ray.get(prefill.read.remote(src))
    src = ray.get(prefill.allocate.remote(2))
    with pytest.raises(StalePeerError, match="incarnation 1"):  # a destination of the dead incarnation
        ray.get(prefill.begin_send.remote("old", KVDestination("decode-0", 1, tuple(dst)), src, 5.0))
    _all_pages_free(prefill, decode2)


def test_kvtransfer_benchmark_reports_the_ratio(peers: tuple[Any, Any]) -> None:
    from tandem.bench.kvtransfer_bench import run_kvtransfer_bench

    result = run_kvtransfer_bench(size_mib=8, repeats=1)
    assert result["bytes_match"] is True
    assert result["nixl_gb_s"] > 0 and result["memcpy_gb_s"] > 0
    assert result["ratio"] == pytest.approx(result["nixl_gb_s"] / result["memcpy_gb_s"], rel=2e-2, abs=2e-3)


def test_peers_connected_ahead_of_a_transfer_then_transfer_as_before(peers: tuple[Any, Any]) -> None:
    """``connect`` (a membership change): each side reaches the other before any transfer and
    the other drops the WARM message (not counted as a late one); connecting again sends
    nothing; a rank not published yet is returned, for its first transfer to connect."""
    prefill, decode = _peer("prefill-9"), _peer("decode-9")
    ray.get([prefill.check.remote(), decode.check.remote()])
    assert ray.get(prefill.connect.remote(["decode-9", "nowhere-0"])) == ["nowhere-0"]
    assert ray.get(decode.connect.remote(["prefill-9", "prefill-9"])) == []
    deadline = time.monotonic() + 10
    while ray.get([prefill.warm_messages.remote(), decode.warm_messages.remote()]) != [1, 1]:
        assert time.monotonic() < deadline, "a WARM message never arrived"
        ray.get([prefill.poll.remote(0.05), decode.poll.remote(0.05)])
    assert ray.get(prefill.connect.remote(["decode-9"])) == []  # already reached: nothing sent
    src = ray.get(prefill.allocate.remote(2))
    ray.get(prefill.fill.remote(src, 3))
    dst = ray.get(decode.allocate.remote(2))
    ray.get(decode.expect.remote("warm-1", "prefill-9", dst, 10.0))
    ray.get(prefill.send.remote("warm-1", KVDestination("decode-9", 1, tuple(dst)), src, True, 10.0))
    _settle(prefill, decode, {"warm-1"})
    assert ray.get(decode.read.remote(dst)) == ray.get(prefill.read.remote(src))
    ray.get([prefill.poll.remote(0.05), decode.poll.remote(0.05)])
    assert ray.get([prefill.warm_messages.remote(), decode.warm_messages.remote()]) == [1, 1]
    assert ray.get([prefill.late_messages_dropped.remote(), decode.late_messages_dropped.remote()]) == [0, 0]
    ray.get([prefill.close.remote(), decode.close.remote()])
    for actor in (prefill, decode):
        ray.kill(actor)
