"""Speculative decoding on the Ray cluster: the ``local`` preset (a DEP2 prefill group and a
DEP2 decode group, real NIXL) with prompt-lookup or MTP drafts gives, over gRPC, exactly the tokens
of plain decoding for greedy and seeded requests, and its bills carry drafts the verify steps
really accepted; a decode rank killed mid-stream hands its speculating streams to another,
which goes on with the same tokens; the reference topology (DEP16 prefill, DEP2 decode) with
MTP drafts gives plain decoding's tokens too. Every page is free and accounted for after each."""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import pytest
import ray
import torch

from tandem.client.grpc_client import ClientOptions, generate_all
from tandem.client.prompts import PromptSpec
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import PoolSpec, SpeculativeSpec, Topology
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.model.tokenizer import Tokenizer
from tandem.model.train_demo import DEMO_DIR
from tandem.wire.messages import RankId, RankStats
from tandem.wire.request_params import SamplingParams
from tandem.wire.stream_summary import StreamSummary

PAGE = 8
TEXTS = [
    "The river runs past the mill. The river runs past the mill and the",
    "Once upon a time there was a king who had three daughters. Once upon a time",
    "She said that she would come back, and she",
    "A B C D A B C D A B",
]


@pytest.fixture(scope="module")
def demo(ray_started: None) -> Path:
    """The demo model: trained on English, its text repeats as real text does, so lookup drafts
    are accepted (a random model's almost never are)."""
    return DEMO_DIR


def _topology(k: int, prefill: PoolSpec, decode: PoolSpec, drafter: str) -> Topology:
    spec = SpeculativeSpec(tokens=k, drafter=drafter)  # type: ignore[arg-type]
    return Topology.preset("local").model_copy(
        update={"prefill": prefill, "decode": decode, "speculative": spec}
    )


def _serve(topology: Topology, model: Path) -> Server:
    server = Server(ServeOptions(topology, model, port=0, dtype="float64"))
    server.start()
    return server


def _expected(model: Path, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[list[int]]:
    engine = ColocatedEngine.from_model_dir(model, torch.float64, EngineConfig(page_size=PAGE, num_pages=512))
    return [o.token_ids for o in engine.generate(prompts, sampling)]


def _all_pages_free(server: Server) -> None:
    ray.get(server.controller.check_integrity.remote())
    stats: list[RankStats] = ray.get(server.controller.stats.remote())
    for s in stats:
        assert s.free_pages == s.total_pages and (s.sends_in_flight, s.receives_in_flight) == (0, 0), s


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_local_preset_with_drafts_gives_plain_decodings_tokens_over_grpc(
    demo: Path, drafter: str, k: int
) -> None:
    sampling = [
        SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.7 if i % 2 else 0.0, top_k=20, seed=i)
        for i in range(2 * len(TEXTS))
    ]
    specs = [PromptSpec(TEXTS[i % len(TEXTS)], None, s) for i, s in enumerate(sampling)]
    page = PoolSpec(dep=2, page_size=PAGE, num_pages=96)
    server = _serve(_topology(k, page, page, drafter), demo)
    try:
        outcomes = asyncio.run(
            generate_all(ClientOptions(f"127.0.0.1:{server.port}", timeout_s=120), specs, 8)
        )
        prompts = [Tokenizer.from_dir(demo).encode(t) for t in (TEXTS * 2)]
        summaries = [o.summary for o in outcomes]
        assert all(s is not None and not s.error for s in summaries)
        assert [list(s.token_ids) for s in summaries if s] == _expected(demo, prompts, sampling)
        spec = [s.bill.speculation for s in summaries if s]
        assert sum(x.accepted_tokens for x in spec) > 0  # drafts were accepted on the DEP2 group
        for x, s in zip(spec, summaries, strict=True):
            assert s is not None and x.steps + x.accepted_tokens == s.bill.output_tokens - 1
            assert x.accepted_tokens <= x.draft_tokens <= k * x.steps
        _all_pages_free(server)
    finally:
        server.stop()


@pytest.mark.parametrize("drafter", ["ngram", "mtp"])
def test_a_decode_rank_killed_while_speculating_hands_its_streams_on_with_the_same_tokens(
    demo: Path, drafter: str
) -> None:
    topology = _topology(
        3,
        PoolSpec(groups=1, dep=1, page_size=PAGE, num_pages=200),
        PoolSpec(groups=2, dep=1, page_size=PAGE, num_pages=200),
        drafter,
    )
    prompts = [Tokenizer.from_dir(demo).encode(t) for t in TEXTS]
    sampling = [
        SamplingParams(max_tokens=800, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i)
        for i in range(len(prompts))
    ]
    server = _serve(topology, demo)
    try:
        done: list[StreamSummary] = []
        thread = threading.Thread(target=lambda: done.extend(server.generate(prompts, sampling)))
        thread.start()
        time.sleep(1.0)
        assert thread.is_alive(), "the streams ended before a decode rank was killed"
        view = ray.get(server.controller.routing_view.remote())
        ray.kill(view.decode[RankId("decode0", 0)])
        thread.join(timeout=300)
        assert [d.error for d in done] == [None] * len(prompts)
        assert [d.token_ids for d in done] == _expected(demo, prompts, sampling)
        moved = [d for d in done if d.bill.migrations]
        assert moved and all(d.decode_rank == RankId("decode1", 0) for d in moved)
        assert sum(d.bill.speculation.accepted_tokens for d in done) > 0
        deadline = time.monotonic() + 120
        while not all(s.startswith("ready") for s in ray.get(server.controller.status.remote()).values()):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        _all_pages_free(server)
    finally:
        server.stop()


def test_the_reference_topology_with_mtp_drafts_gives_plain_decodings_tokens(
    ray_started: None, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """``dep16-dep2`` (one DEP16 prefill group, one DEP2 decode group) on a tiny checkpoint with a
    (random) MTP layer: every prefill rank runs the MTP layer's MoE with the group, the decode
    group drafts with it, and greedy and seeded tokens are plain decoding's."""
    model = make_tiny_checkpoint(tmp_path_factory.mktemp("mtp") / "tiny", seed=0, num_nextn_predict_layers=1)
    topology = Topology.preset("dep16-dep2").model_copy(
        update={
            "prefill": PoolSpec(groups=1, dep=16, page_size=PAGE, num_pages=64),
            "decode": PoolSpec(groups=1, dep=2, page_size=PAGE, num_pages=96),
            "speculative": SpeculativeSpec(tokens=3, drafter="mtp"),
        }
    )
    prompts = [[(7 * i + 3 * j) % 256 for j in range(5 + 9 * i)] for i in range(6)]
    sampling = [
        SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i)
        for i in range(6)
    ]
    server = _serve(topology, model)
    try:
        done = server.generate(prompts, sampling)
        assert [d.error for d in done] == [None] * len(prompts)
        assert [d.token_ids for d in done] == _expected(model, prompts, sampling)
        assert sum(d.bill.speculation.draft_tokens for d in done) > 0
        _all_pages_free(server)
    finally:
        server.stop()


def _wait_all_pages_free(server: Server, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            _all_pages_free(server)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def test_a_deadline_and_a_cancel_while_speculating_free_every_page(demo: Path) -> None:
    """MTP drafts on the local preset: a request whose gRPC deadline passes mid-stream and one
    whose client cancels it after its first chunks both end on the ranks, and every page (the
    drafts' too) is free and accounted for."""
    import grpc

    from tandem.client.grpc_client import request_message
    from tandem.protos import tandem_pb2_grpc

    page = PoolSpec(dep=2, page_size=PAGE, num_pages=256)  # room for the 1500-token request
    server = _serve(_topology(3, page, page, "mtp"), demo)
    addr = f"127.0.0.1:{server.port}"
    long = PromptSpec(TEXTS[0], None, SamplingParams(max_tokens=1500, ignore_eos=True))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as error:
            asyncio.run(generate_all(ClientOptions(addr, timeout_s=1.0), [long], 1))
        assert error.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
        _wait_all_pages_free(server)

        async def cancel_midway() -> int:
            async with grpc.aio.insecure_channel(addr) as channel:
                call = tandem_pb2_grpc.TandemStub(channel).Generate(request_message(long, "cancel-me"))
                chunks = 0
                async for response in call:
                    chunks += response.HasField("chunk")
                    if chunks == 3:
                        call.cancel()
                        break
                return chunks

        assert asyncio.run(cancel_midway()) == 3
        _wait_all_pages_free(server)
    finally:
        server.stop()
