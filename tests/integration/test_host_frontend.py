"""The frontend capacity benchmark end to end at a small scale: the real frontend actor, fake
decode ranks pushing tokens and bills, gRPC clients in their own process. Every stream gets all
its tokens in order (the clients check; a wrong stream fails the round), and the figures agree
with each other. No figure is held to a speed."""

from __future__ import annotations

from tandem.bench.host_frontend import CATEGORIES, measure_frontend


def test_small_run_streams_every_token_and_reports_consistent_figures() -> None:
    result = measure_frontend(streams=(8,), output_tokens=16, top=5, repeats=2)
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
