"""DeepSeek-V4 on the disaggregated cluster (Ray, real NIXL): a tiny V4 through ``local`` (a DEP2
prefill group, a DEP2 decode group) gives the colocated engine's tokens (themselves
transformers', ``tests/engine/test_v4_engine.py``), greedy and seeded, over the path gRPC
requests take and over the OpenAI API with the official client; a second wave sharing the
first's prefixes hits the prefill ranks' caches (restored exactly from their window slots); every
page and every state slot is free at the end. Each request's compressed entries and indexer keys
cross in its pages and the rest of its state in a slot, layer by layer: the bill's bytes are
those of the prompt's pages of each kind and one slot."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai
import pytest
import ray
import torch

from tandem.bench.v4_transfer_bytes import transfer_bytes
from tandem.client.grpc_client import ClientOptions, generate_all, request_message
from tandem.client.prompts import PromptSpec
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import PoolSpec, Topology
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.model.v4.config import V4Config
from tandem.protos import tandem_pb2, tandem_pb2_grpc
from tandem.wire.request_params import SamplingParams
from tests.hf_v4_reference import write_tiny_v4

PAGE = 16  # a multiple of the tiny model's rates 4 and 16


@dataclass
class Served:
    server: Server
    model_dir: Path
    base_url: str


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory, ray_started: None) -> Iterator[Served]:
    model_dir = tmp_path_factory.mktemp("v4cluster") / "model"
    write_tiny_v4(model_dir, seed=3, index_topk=3)
    pool = PoolSpec(dep=2, page_size=PAGE, num_pages=120, max_num_seqs=16)
    topology = Topology.preset("local").model_copy(update={"prefill": pool, "decode": pool})
    server = Server(ServeOptions(topology, model_dir, port=0, dtype="float64", http_port=0))
    try:
        server.start()
        assert server.http_address is not None
        yield Served(server, model_dir, f"http://{server.http_address}/v1")
    finally:
        server.stop()


def _chats(seed: int) -> list[tuple[list[int], SamplingParams]]:
    """Two waves of 8: the second extends the first's prompts (a shared system prompt of three
    pages, then each turn). Odd requests sample with a seed."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 256) for _ in range(3 * PAGE)]
    first = [system + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 40))] for _ in range(8)]
    second = [p + [rng.randrange(3, 256) for _ in range(rng.randrange(1, 20))] for p in first]
    return [
        (p, SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.8 if i % 2 else 0.0, seed=i))
        for i, p in enumerate(first + second)
    ]


def _expected(model_dir: Path, requests: list[tuple[list[int], SamplingParams]]) -> list[list[int]]:
    engine = ColocatedEngine.from_model_dir(
        model_dir, torch.float64, EngineConfig(page_size=PAGE, num_pages=512)
    )
    return [o.token_ids for o in engine.generate([p for p, _ in requests], [s for _, s in requests])]


def test_the_local_preset_gives_the_colocated_tokens_and_its_prefix_hits(served: Served) -> None:
    requests = _chats(seed=1)
    done = []
    for wave in (requests[:8], requests[8:]):
        done += served.server.generate([p for p, _ in wave], [s for _, s in wave])
    assert [d.error for d in done] == [None] * len(requests)
    assert [d.token_ids for d in done] == _expected(served.model_dir, requests)
    cfg = V4Config.from_dir(served.model_dir)
    for d, (prompt, _) in zip(done, requests, strict=True):  # the layout's bytes, float64
        assert d.bill.kv_bytes == transfer_bytes(cfg, len(prompt), PAGE, 8), (len(prompt), d.bill)
    warm = {d.prefill_rank for d in done[:8]}
    repeated = [d.bill for d in done[8:] if d.prefill_rank in warm]
    assert repeated and all(b.cached_tokens >= 2 * PAGE for b in repeated)
    ray.get(served.server.controller.check_integrity.remote())
    for stats in ray.get(served.server.controller.stats.remote()):
        assert stats.free_pages == stats.total_pages, stats
        assert (stats.sends_in_flight, stats.receives_in_flight) == (0, 0), stats


def test_the_openai_api_gives_the_colocated_tokens(served: Served) -> None:
    client = openai.OpenAI(base_url=served.base_url, api_key="none", max_retries=0, timeout=120)
    prompt = [random.Random(7).randrange(3, 256) for _ in range(45)]
    whole = client.completions.create(
        model=served.server.model_name,
        prompt=prompt,
        max_tokens=10,
        temperature=0.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    got = whole.choices[0].model_extra["token_ids"]  # type: ignore[index]
    assert got == _expected(served.model_dir, [(prompt, SamplingParams(max_tokens=10, ignore_eos=True))])[0]


async def _first_chunks(stub: Any, message: Any, n: int, **kwargs: Any) -> Any:
    call = stub.Generate(message, **kwargs)
    seen = 0
    async for response in call:
        seen += response.HasField("chunk")
        if seen >= n:
            return call
    raise AssertionError("the stream ended early")


def _settled(server: Server, timeout_s: float = 30.0) -> None:
    """Every page and state slot free again, nothing in flight (``check_integrity`` finds a
    slot held with no transfer under way)."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = ray.get(server.controller.stats.remote())
        free = all(
            s.free_pages == s.total_pages
            and (s.sends_in_flight, s.receives_in_flight) == (0, 0)
            and not s.running
            for s in stats
        )
        if free:
            ray.get(server.controller.check_integrity.remote())
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.1)


def test_a_cancelled_an_aborted_and_an_overdue_v4_stream_each_free_everything(served: Served) -> None:
    """Over gRPC, three long V4 streams end early: the client cancels one, the Abort RPC ends
    another (its summary says so), a deadline the third; each time every page and state slot is
    free again, and the next request gets the colocated engine's tokens."""
    server = served.server
    address = f"127.0.0.1:{server.port}"
    long = PromptSpec(None, list(range(3, 40)), SamplingParams(max_tokens=1500, ignore_eos=True))

    async def cancel_and_abort() -> tandem_pb2.Summary:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = tandem_pb2_grpc.TandemStub(channel)
            call = await _first_chunks(stub, request_message(long, "v4-cancel"), 3)
            call.cancel()
            call = await _first_chunks(stub, request_message(long, "v4-abort"), 2)
            reply = await stub.Abort(tandem_pb2.AbortRequest(request_id="v4-abort"))
            assert reply.found
            async for response in call:
                if response.HasField("summary"):
                    return response.summary
            raise AssertionError("no summary")

    summary = asyncio.run(cancel_and_abort())
    assert summary.finish_reason == "abort" and 2 <= summary.bill.output_tokens < 1500
    _settled(server)
    with pytest.raises(grpc.aio.AioRpcError) as error:
        asyncio.run(generate_all(ClientOptions(address, timeout_s=1.0), [long], 1))
    assert error.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
    _settled(server)
    after = PromptSpec(None, list(range(5, 60)), SamplingParams(max_tokens=8, ignore_eos=True))
    (outcome,) = asyncio.run(generate_all(ClientOptions(address, timeout_s=120), [after], 1))
    want = _expected(served.model_dir, [(list(range(5, 60)), after.sampling)])[0]
    assert outcome.record()["token_ids"] == want
    _settled(server)
