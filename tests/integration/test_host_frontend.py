"""The frontend capacity benchmark end to end at a small scale: the real frontend actor, fake
decode ranks pushing tokens and bills, fake prefill ranks caching prompts and publishing KV
events, gRPC clients in their own process. Every stream gets all its tokens in order and its
text (the clients check both against the workload; a wrong stream fails the round), the
realistic workload really hashes, routes on and indexes blocks, and the figures agree with each
other. No figure is held to a speed."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.bench.fake_ranks import PAGE_SIZE
from tandem.bench.frontend_workload import MIN_SUFFIX_TOKENS, PREFIX_TOKENS, PROMPT_TOKENS
from tandem.bench.host_frontend import CATEGORIES, measure_frontend

PREFILL_PAGES = 256  # small enough that the fake prefill ranks' caches evict within the run


@pytest.fixture(scope="module")
def result() -> dict[str, Any]:
    """One small run of both workloads (the realistic one's tokenizer is trained on first use)."""
    return measure_frontend(
        streams=(8,), output_tokens=16, top=5, repeats=2, workload="both", prefill_pages=PREFILL_PAGES
    )


def test_small_run_streams_every_token_and_reports_consistent_figures(result: dict[str, Any]) -> None:
    figures = result["by_streams"]["8"]
    assert result["at_streams"] == 8
    assert figures["tokens"] == 8 * 16  # every stream completed with all its tokens
    assert figures["frontend_cpu_s"] > 0 and figures["client_wall_s"] > 0
    assert figures["frontend_loop_thread_cpu_s"] <= figures["frontend_cpu_s"]
    assert result["frontend_tokens_per_s_per_core"] == figures["tokens_per_s_per_core"]
    assert (
        abs(figures["tokens_per_s_per_core"] * figures["frontend_cpu_s"] - figures["tokens"])
        < 0.01 * figures["tokens"]
    )
    assert 1 <= figures["messages"] <= figures["tokens"]  # chunks may carry several tokens, never none
    # the ranks held their steps until all 8 streams ran: each rank holding streams made 16
    # steps, each a token for every stream it held (a stream admitted late would add steps)
    assert figures["rank_pushes"] in (16, 32) and figures["tokens_per_push"] in (4.0, 8.0)
    assert len(figures["rounds_tokens_per_s_per_core"]) == 2
    assert figures["tokens_per_s_per_core"] in figures["rounds_tokens_per_s_per_core"]
    # the client's wait for its first chunk holds the frontend's (arrival -> first token)
    assert figures["client_ttft_ms"]["p50"] >= figures["frontend_ttft_ms"]["p50"] > 0
    profile = figures["profile"]
    assert profile["profiled_s"] > 0 and set(profile["share"]) == {n for n, _ in CATEGORIES} | {"other"}
    assert abs(sum(profile["share"].values()) - 1) < 0.01 and len(profile["top"]) == 5


def test_the_realistic_workload_hashes_routes_and_indexes_blocks(result: dict[str, Any]) -> None:
    # the default workload: a tokenizer of at least 100,000 ids, long prompts behind shared prefixes,
    # streams with characters of several bytes
    assert result["workload"] == "realistic" and result["vocab_size"] >= 100_000
    facts = result["workload_facts"]
    assert facts["tokenizer"]["vocab_size"] == result["vocab_size"]
    assert PROMPT_TOKENS[0] <= facts["prompt_tokens"]["min"]
    assert facts["prompt_tokens"]["max"] <= max(PROMPT_TOKENS[1], max(PREFIX_TOKENS) + MIN_SUFFIX_TOKENS)
    assert facts["shared_prefix_tokens"] == list(PREFIX_TOKENS) and 0 < facts["shared_prefix_share"] < 1
    assert facts["non_ascii_token_share"] > 0
    # every prompt's full pages hashed at the frontend, and routed on the blocks the prefill
    # ranks reported: the shared prefixes, cached since the warm-up, are found in the index
    figures = result["by_streams"]["8"]
    assert figures["requests_routed"] == 8
    assert figures["blocks_hashed"] >= 8 * PROMPT_TOKENS[0] // PAGE_SIZE
    assert figures["kv_events_applied"] > 0 and figures["blocks_matched"] > 0
    routing = result["routing"]
    assert routing["prefill_jobs"] == routing["requests_routed"]  # every prompt reached its prefill rank
    assert 0 < routing["blocks_matched"] < routing["blocks_hashed"]
    assert routing["kv_event_batches_pushed"] > 0 and routing["kv_events_applied"] > 0
    # the caches are bounded: full, they evict, and the index follows them
    assert routing["kv_blocks_removed"] > 0
    assert 0 < routing["indexed_blocks"] <= result["prefill_ranks"] * PREFILL_PAGES
    assert routing["indexed_blocks"] == routing["kv_blocks_stored"] - routing["kv_blocks_removed"]
    # the old, easy case beside it: the demo tokenizer, one 32-token prompt, nothing to hash
    easy = result["easy"]
    assert easy["workload"] == "easy" and easy["vocab_size"] == 258 and easy["prompt_tokens"] == 32
    assert easy["by_streams"]["8"]["tokens"] == 8 * 16
    assert easy["routing"]["blocks_hashed"] == 0 and easy["routing"]["indexed_blocks"] == 0
    assert set(result["side_by_side"]) == {"realistic", "easy"}
    assert result["side_by_side"]["easy"]["8"] == easy["by_streams"]["8"]["tokens_per_s_per_core"]
