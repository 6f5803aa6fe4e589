"""``bench/serve_stats.py`` on hand-made requests whose figures are known."""

from __future__ import annotations

import json
import math

import pytest

from tandem.bench.serve_price import point_prices
from tandem.bench.serve_report import format_table, tables, to_json
from tandem.bench.serve_stats import (
    Pools,
    RequestRecord,
    composition_ms,
    meets_slo,
    percentile,
    point_stats,
)
from tandem.wire.messages import CachedByTier


def record(
    sent: float,
    arrivals: list[tuple[float, int]],
    done: float,
    cached: int = 0,
    new: int = 10,
    **latency: float,
) -> RequestRecord:
    output = sum(n for _, n in arrivals)
    return RequestRecord(
        sent_s=sent,
        chunks=arrivals,
        done_s=done,
        prompt_tokens=cached + new,
        cached_tokens=cached,
        new_prompt_tokens=new,
        output_tokens=output,
        latency_s=latency,
    )


def test_percentiles_interpolate_between_closest_ranks() -> None:
    values = [4.0, 1.0, 3.0, 2.0, 5.0]  # unsorted on purpose
    assert percentile(values, 50) == 3.0
    assert percentile(values, 0) == 1.0 and percentile(values, 100) == 5.0
    assert percentile(values, 90) == pytest.approx(4.6)  # position 3.6: 4 + 0.6 * (5 - 4)
    assert percentile(list(range(1, 101)), 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))
    with pytest.raises(ValueError, match="q: must be in"):
        percentile([1.0], 101)


def test_a_requests_ttft_itl_tpot_and_e2e_come_from_its_chunk_arrivals() -> None:
    # sent at 10; token 0 at 10.5; tokens 1-2 together at 10.9 (a merged chunk); token 3 at 11.0
    r = record(10.0, [(10.5, 1), (10.9, 2), (11.0, 1)], done=11.1)
    assert r.ttft_s == pytest.approx(0.5)
    assert r.e2e_s == pytest.approx(1.1)
    assert r.itls_s == pytest.approx([0.2, 0.2, 0.1])  # the merged chunk's 0.4 s over its 2 tokens
    assert r.tpot_s == pytest.approx(0.5 / 3)  # last - first over output - 1 = the mean ITL
    assert sum(r.itls_s) / len(r.itls_s) == pytest.approx(r.tpot_s)
    single = record(0.0, [(0.3, 1)], done=0.4)
    assert single.itls_s == [] and single.tpot_s is None


def test_goodput_counts_only_requests_within_both_slos() -> None:
    fast = record(0.0, [(0.1, 1), (0.15, 1), (0.2, 1)], done=0.2)  # ttft 100 ms, mean ITL 50 ms
    slow_first = record(0.0, [(0.6, 1), (0.65, 1)], done=0.7)  # ttft 600 ms
    slow_gaps = record(0.0, [(0.1, 1), (0.4, 1)], done=0.4)  # ITL 300 ms
    one_token = record(0.0, [(0.2, 1)], done=0.2)  # no gap: meets ITL
    failed = RequestRecord(sent_s=0.0, error="UNAVAILABLE: no prefill rank")
    assert [meets_slo(r, 500, 100) for r in (fast, slow_first, slow_gaps, one_token, failed)] == [
        True, False, False, True, False,
    ]  # fmt: skip
    stats = point_stats([fast, slow_first, slow_gaps, one_token, failed], 2.0, Pools(2, 2), 500, 100, 4)
    assert stats["goodput_rps"] == pytest.approx(2 / 2.0)
    assert stats["request_throughput"] == pytest.approx(4 / 2.0)
    assert stats["completed"] == 4 and stats["failed"] == 1
    assert stats["errors"] == ["UNAVAILABLE: no prefill rank"]
    assert stats["concurrency"] == 4


def test_token_throughput_splits_cached_and_new_input_per_rank_and_pool() -> None:
    a = record(0.0, [(0.1, 1), (0.2, 3)], done=0.2, cached=64, new=36)  # 4 output tokens
    b = record(0.0, [(0.1, 2)], done=0.3, cached=0, new=100)  # 2 output tokens
    failed = record(0.0, [(0.1, 50)], done=0.2, cached=1000, new=1000)
    failed.error = "finished with error"  # its tokens are not counted
    stats = point_stats([a, b, failed], 2.0, Pools(prefill_ranks=2, decode_ranks=1), 1e9, 1e9)
    assert stats["input_tokens_per_s"] == {"cached": 32.0, "new": 68.0}
    assert stats["output_tokens_per_s"] == 3.0 and stats["output_tokens"] == 6
    assert stats["per_rank"] == {"input_tokens_per_s": 200 / 3 / 2.0, "output_tokens_per_s": 1.0}
    assert stats["per_prefill_rank"] == {"cached": 16.0, "new": 34.0}
    assert stats["per_decode_rank"] == {"output_tokens_per_s": 3.0}
    assert stats["cache_hit_share"] == pytest.approx(64 / 200)
    assert stats["cached_tokens"] == 64 and stats["prompt_tokens"] == 200


def test_percentiles_of_a_point_pool_requests_and_gaps() -> None:
    records = [
        record(0.0, [(t, 1), (t + 0.01 * (i + 1), 1)], done=1.0) for i, t in enumerate([0.1, 0.2, 0.3])
    ]
    stats = point_stats(records, 1.0, Pools(1, 1), 1e9, 1e9)
    assert stats["ttft_ms"]["p50"] == pytest.approx(200.0)
    assert stats["ttft_ms"]["p90"] == pytest.approx(280.0)
    assert stats["itl_ms"]["p50"] == pytest.approx(20.0)
    assert stats["tpot_ms"]["p99"] == pytest.approx(29.8)
    assert stats["e2e_ms"] == {"p50": 1000.0, "p90": 1000.0, "p99": 1000.0}
    assert stats["interactivity_tokens_per_s"] == pytest.approx(50.0)  # 1000 / 20 ms


def test_composition_is_the_mean_of_each_bill_field_in_ms() -> None:
    a = record(0.0, [(0.1, 1)], done=0.1, queue_s=0.010, prefill_compute_s=0.100, decode_s=0.5)
    b = record(0.0, [(0.1, 1)], done=0.1, queue_s=0.030, prefill_compute_s=0.300, decode_s=0.1)
    means = composition_ms([a, b])
    assert means["queue"] == pytest.approx(20.0)
    assert means["prefill_compute"] == pytest.approx(200.0)
    assert means["decode"] == pytest.approx(300.0)
    assert means["routing"] == 0.0  # absent from both bills
    assert math.isnan(composition_ms([])["queue"])


def test_predicted_against_found_cached_tokens_are_summed() -> None:
    a = record(0.0, [(0.1, 1)], done=0.1, cached=64, new=0)
    a.predicted_cached_tokens = 128
    b = record(0.0, [(0.1, 1)], done=0.1, cached=0, new=64)
    b.predicted_cached_tokens = 64
    stats = point_stats([a, b], 1.0, Pools(1, 1), 1e9, 1e9)
    assert (stats["predicted_cached_tokens"], stats["cached_tokens"]) == (192, 64)


def test_a_colocated_rank_counts_once_per_rank_and_in_each_role() -> None:
    a = RequestRecord(sent_s=0.0, chunks=[(0.1, 1), (0.2, 1)], done_s=0.2)
    a.prompt_tokens, a.new_prompt_tokens, a.output_tokens = 40, 40, 2
    stats = point_stats([a], 1.0, Pools(0, 0, colocated_ranks=4), 1e9, 1e9)
    assert stats["per_rank"]["input_tokens_per_s"] == 10.0
    assert stats["per_prefill_rank"]["new"] == 10.0 and stats["per_decode_rank"]["output_tokens_per_s"] == 0.5


def test_the_cache_hit_share_splits_by_tier_and_the_report_shows_it() -> None:
    a = record(0.0, [(0.1, 1)], done=0.1, cached=96, new=32)
    a.cached_tokens_by_tier = CachedByTier(device=64, host=32)
    b = record(0.0, [(0.1, 1)], done=0.1, cached=48, new=80)
    b.cached_tokens_by_tier = CachedByTier(device=16, store=32)
    failed = record(0.0, [(0.1, 1)], done=0.1, cached=100, new=0)
    failed.cached_tokens_by_tier = CachedByTier(store=100)
    failed.error = "finished with error"  # not counted
    stats = point_stats([a, b, failed], 1.0, Pools(1, 1), 1e9, 1e9, concurrency=2)
    assert stats["cached_tokens_by_tier"] == {"device": 80, "host": 32, "store": 32}
    assert sum(stats["cached_tokens_by_tier"].values()) == stats["cached_tokens"] == 144
    shares = stats["cache_hit_share_by_tier"]
    assert shares == pytest.approx({"device": 80 / 256, "host": 32 / 256, "store": 32 / 256})
    assert sum(shares.values()) == pytest.approx(stats["cache_hit_share"])
    assert stats["new_prompt_tokens"] == 112 and stats["prompt_tokens"] == 256
    result = {
        "deployment": {"addr": "a:1", "model": "m", "prefill_ranks": 1, "decode_ranks": 1},
        "workload": {"kind": "synthetic", "prompt_tokens": 128, "shared_prefix_tokens": 64, "prefixes": 2,
                     "output_tokens": 1},
        "points": [stats],
    }  # fmt: skip
    latency = tables(result)[0]
    column = latency[1].index("hit device/host/store")
    assert latency[2][0][column] == "31.2/12.5/12.5%"
    assert "hit device/host/store" in format_table(result)
    assert json.loads(to_json(result))["points"][0]["cache_hit_share_by_tier"]["host"] == 0.125
    empty = point_stats([failed], 1.0, Pools(1, 1), 1e9, 1e9)
    assert tables({**result, "points": [empty]})[0][2][0][column] == "-"


def test_a_gpu_hour_price_charges_each_pool_to_the_tokens_it_serves() -> None:
    """Two prefill and one decode rank for an hour at $3 a GPU-hour: the decode rank's $3 over
    the output tokens, the prefill ranks' $6 over the prompt tokens with a cached one a tenth of
    a new one; the blended price is the $9 over every token. A colocated deployment has only
    the blended price. The report shows the prices when asked for."""
    point = {"wall_s": 3600.0, "new_prompt_tokens": 1_000_000, "cached_tokens": 2_000_000,
             "output_tokens": 500_000}  # fmt: skip
    prices = point_prices(point, {"prefill_ranks": 2, "decode_ranks": 1}, 3.0, 0.1)
    assert prices["output"] == pytest.approx(6.0)  # $3 / 0.5 M
    assert prices["new_input"] == pytest.approx(6.0 / 1.2)  # $6 / (1 M + 0.1 x 2 M)
    assert prices["cached_input"] == pytest.approx(0.6 / 1.2)
    spent = prices["new_input"] + 2 * prices["cached_input"] + 0.5 * prices["output"]
    assert spent == pytest.approx(9.0)  # every dollar charged once
    assert prices["blended"] == pytest.approx(9.0 / 3.5)
    colocated = point_prices(point, {"colocated_ranks": 4}, 3.0, 0.1)
    assert math.isnan(colocated["output"]) and colocated["blended"] == pytest.approx(12.0 / 3.5)
    none_cached = point_prices(
        {**point, "cached_tokens": 0}, {"prefill_ranks": 1, "decode_ranks": 1}, 3.0, 0.1
    )
    assert math.isnan(none_cached["cached_input"]) and none_cached["new_input"] == pytest.approx(3.0)
    stats = point_stats([record(0.0, [(0.1, 1)], done=0.1, cached=96, new=32)], 1.0, Pools(1, 1), 1e9, 1e9)
    stats["price_per_mtok"] = point_prices(stats, {"prefill_ranks": 1, "decode_ranks": 1}, 2.5, 0.1)
    result = {
        "deployment": {"addr": "a:1", "model": "m", "prefill_ranks": 1, "decode_ranks": 1},
        "workload": {"kind": "synthetic", "prompt_tokens": 128, "shared_prefix_tokens": 64, "prefixes": 2,
                     "output_tokens": 1},
        "points": [stats],
        "gpu_hour_price": 2.5,
    }  # fmt: skip
    title, header, rows = tables(result)[-1]
    assert title == "price at $2.5 per GPU-hour" and header[1] == "cached input $/Mtok"
    assert float(rows[0][2]) == pytest.approx(stats["price_per_mtok"]["new_input"], rel=1e-3)
    assert "blended $/Mtok" in format_table(result)
