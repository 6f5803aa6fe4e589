"""A bill through the gRPC edge and back: the servicer's protobuf of a summary, its bytes parsed
as a client would, and the client's ``--json`` record and bill line made from it."""

from __future__ import annotations

from tandem.client.grpc_client import Outcome, bill_line
from tandem.frontend.grpc_service import _response
from tandem.protos import tandem_pb2
from tandem.wire.messages import Bill, CachedByTier, PrefillAttempt, RankId
from tandem.wire.request_params import FinishReason
from tandem.wire.stream_summary import Route, StreamSummary


def _summary() -> StreamSummary:
    # a transfer that failed after its prefill found 16 tokens on device, then a retry on
    # another rank that found 16 on device, 32 in its host pool and 8 in the store
    first = PrefillAttempt(
        attempt=0, prefill_rank=RankId("prefill0", 0), delivered=False, error="timeout", prompt_tokens=64,
        cached_tokens=16, cached_by_tier=CachedByTier(device=16),
    )  # fmt: skip
    retry = PrefillAttempt(
        attempt=1, prefill_rank=RankId("prefill1", 0), delivered=True, prompt_tokens=64, cached_tokens=56,
        cached_by_tier=CachedByTier(device=16, host=32, store=8), kv_bytes=8192,
    )  # fmt: skip
    bill = Bill(
        prompt_tokens=64, cached_tokens=56, cached_tokens_by_tier=retry.cached_by_tier, new_prompt_tokens=8,
        output_tokens=2, attempts=(first, retry),
    )  # fmt: skip
    route = Route(RankId("prefill0", 0), RankId("decode0", 0), 16, "cache_hit", queue_s=0.0, routing_s=0.0)
    return StreamSummary(
        FinishReason.LENGTH, None, [5, 6], "ab", bill, route, retry.prefill_rank, route.decode_rank,
        ttft_s=0.1, e2e_s=0.2,
    )  # fmt: skip


def _over_the_wire() -> tandem_pb2.Summary:
    sent = _response("r-1", _summary())
    return tandem_pb2.GenerateResponse.FromString(sent.SerializeToString()).summary


def test_the_bill_and_each_attempt_carry_the_split_by_tier() -> None:
    bill = _over_the_wire().bill
    by_tier = bill.cached_tokens_by_tier
    assert (by_tier.device, by_tier.host, by_tier.store) == (16, 32, 8)
    assert by_tier.device + by_tier.host + by_tier.store == bill.cached_tokens == 56
    attempts = [(a.cached_tokens_by_tier.device, a.cached_tokens_by_tier.host, a.cached_tokens_by_tier.store)
                for a in bill.attempts]  # fmt: skip
    assert attempts == [(16, 0, 0), (16, 32, 8)]
    assert [a.cached_tokens for a in bill.attempts] == [16, 56]


def test_the_field_numbers_are_new_ones() -> None:
    """Old readers skip the split: its numbers are ones no earlier field had."""
    bill_fields = tandem_pb2.Bill.DESCRIPTOR.fields_by_name
    attempt_fields = tandem_pb2.Attempt.DESCRIPTOR.fields_by_name
    assert bill_fields["cached_tokens_by_tier"].number == 12
    assert attempt_fields["cached_tokens_by_tier"].number == 15
    tiers = tandem_pb2.CachedTokensByTier.DESCRIPTOR.fields_by_name
    assert {name: f.number for name, f in tiers.items()} == {"device": 1, "host": 2, "store": 3}


def test_the_clients_json_and_line_show_the_split() -> None:
    outcome = Outcome(0, summary=_over_the_wire())
    record = outcome.record()
    assert record["cached_tokens"] == 56
    assert record["cached_tokens_by_tier"] == {"device": 16, "host": 32, "store": 8}
    assert record["bill"]["cached_tokens_by_tier"] == {"device": 16, "host": 32, "store": 8}
    assert [a["cached_tokens_by_tier"] for a in record["bill"]["attempts"]] == [
        {"device": 16, "host": 0, "store": 0},
        {"device": 16, "host": 32, "store": 8},
    ]
    assert "(cached 56: device 16, host 32, store 8, new 8)" in bill_line(outcome)


def test_a_device_only_bill_keeps_its_short_line() -> None:
    summary = _over_the_wire()
    summary.bill.cached_tokens_by_tier.CopyFrom(tandem_pb2.CachedTokensByTier(device=56))
    line = bill_line(Outcome(0, summary=summary))
    assert "(cached 56, new 8)" in line
