"""The OpenAI-compatible HTTP API on a real deployment (Ray, NIXL, uvicorn and gRPC on loopback),
spoken to with the official ``openai`` client: one prefill and one decode rank, float64, pages of
8 tokens, clients' bearer tokens (two with private caches, two sharing a cache salt, an admin),
metrics on. One server for the module.
"""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx2 as httpx
import openai
import pytest
import ray
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from tandem.client.grpc_client import ClientOptions, client_totals, generate_all
from tandem.client.grpc_client import status as grpc_status
from tandem.client.prompts import PromptSpec
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import PoolSpec, Topology
from tandem.frontend.limits import EdgeLimits
from tandem.protos import tandem_pb2, tandem_pb2_grpc
from tandem.wire.request_params import SamplingParams

PAGE = 8
TOKEN = "tok-alice"
TOKENS = (
    f"alice:{TOKEN}\nbob:tok-bob\n"
    "carol:tok-carol cache_salt=team\ndave:tok-dave cache_salt=team\nops:tok-ops admin\n"
)
AUTH = (("authorization", f"Bearer {TOKEN}"),)


@dataclass
class Served:
    server: Server
    base_url: str
    grpc_addr: str
    metrics_url: str

    def client(self, token: str = TOKEN) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.base_url, api_key=token, max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def served(tiny_dir: Path) -> Iterator[Served]:
    pool = PoolSpec(dep=1, page_size=PAGE, num_pages=200)
    topology = Topology.preset("local").model_copy(update={"prefill": pool, "decode": pool})
    options = ServeOptions(
        topology, tiny_dir, port=0, dtype="float64", auth_token=TOKENS, http_port=0, metrics_port=0
    )
    server = Server(options)
    try:
        server.start()
        assert server.http_address is not None and server.metrics_address is not None
        yield Served(
            server,
            f"http://{server.http_address}/v1",
            f"127.0.0.1:{server.port}",
            f"http://{server.metrics_address}/metrics",
        )
    finally:
        server.stop()
        ray.shutdown()


def _status(served: Served) -> tandem_pb2.ClusterStatusResponse:
    with grpc.insecure_channel(served.grpc_addr) as channel:
        request = tandem_pb2.ClusterStatusRequest(check_integrity=True)
        reply: tandem_pb2.ClusterStatusResponse = tandem_pb2_grpc.TandemStub(channel).ClusterStatus(
            request, metadata=AUTH, timeout=30
        )
        return reply


def _wait_all_pages_free(served: Served, timeout_s: float = 60.0) -> None:
    """Every rank's pages free (a prefill rank's cached prefixes count: they are evictable), no
    transfer open, page accounting intact, nothing running."""
    deadline = time.monotonic() + timeout_s
    while True:
        status = _status(served)
        ranks = [r for g in status.groups for r in g.ranks]
        settled = status.running_requests == 0 and all(
            r.free_pages == r.total_pages and r.transfers_in_flight == 0 and r.running == 0 and r.queued == 0
            for r in ranks
        )
        if settled or time.monotonic() > deadline:
            assert all(r.integrity == "ok" for r in ranks), [(r.name, r.integrity) for r in ranks]
            assert settled, status
            return
        time.sleep(0.1)


def _requests_counted(served: Served, finish_reason: str, code: str) -> float:
    text = httpx.get(served.metrics_url, timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "tandem_requests_total"
        and sample.labels.get("finish_reason") == finish_reason
        and sample.labels.get("code") == code
    )


def test_health_and_models(served: Served) -> None:
    assert httpx.get(served.base_url.removesuffix("/v1") + "/health", timeout=30).status_code == 200
    assert [m.id for m in served.client().models.list()] == [served.server.model_name]


def test_completions_whole_and_streamed_give_the_same_tokens(served: Served) -> None:
    client, model = served.client(), served.server.model_name
    args: dict[str, Any] = {"model": model, "prompt": "Once upon a time", "max_tokens": 10, "seed": 3}
    whole = client.completions.create(**args, extra_body={"ignore_eos": True, "return_token_ids": True})
    choice = whole.choices[0]
    assert choice.finish_reason == "length" and whole.object == "text_completion"
    assert len(choice.model_extra["token_ids"]) == 10  # type: ignore[index]
    assert whole.usage is not None
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens, whole.usage.total_tokens) == (
        17,
        10,
        27,
    )
    stream = client.completions.create(
        **args, stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}
    )
    chunks = list(stream)
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 10
    assert chunks[-2].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks[:-1]) == choice.text


def test_chat_whole_and_streamed(served: Served) -> None:
    client, model = served.client(), served.server.model_name
    messages: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello?"}]
    whole = client.chat.completions.create(
        model=model, messages=messages, max_completion_tokens=8, seed=5, extra_body={"ignore_eos": True}
    )
    assert whole.object == "chat.completion" and whole.choices[0].finish_reason == "length"
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    # BOS + "Be brief." + "<｜User｜>" + "Hello?" + "<｜Assistant｜>", byte by byte
    assert whole.usage.prompt_tokens == 1 + len("Be brief.<｜User｜>Hello?<｜Assistant｜>".encode())
    stream = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=8,
        seed=5,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content


def test_a_stop_string_cuts_the_text_and_frees_the_pages(served: Served) -> None:
    client, model = served.client(), served.server.model_name
    args: dict[str, Any] = {"model": model, "prompt": "The stop test", "max_tokens": 40, "seed": 9}
    full = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    # a stop string from the middle of the text (one without replacement characters)
    at = next(i for i in range(4, len(full) - 1) if "\ufffd" not in full[i : i + 2])
    stop = full[at : at + 2]
    aborted = _requests_counted(served, "abort", "OK")
    cut = client.completions.create(**args, stop=[stop], extra_body={"ignore_eos": True})
    assert cut.choices[0].text == full[: full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(**args, stop=stop, stream=True, extra_body={"ignore_eos": True})
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks) == full[: full.index(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"
    # each was aborted on its decode rank, which reported the abort
    assert _requests_counted(served, "abort", "OK") == aborted + 2
    _wait_all_pages_free(served)


def test_a_repeated_long_prompt_reports_cached_tokens(served: Served) -> None:
    client, model = served.client(), served.server.model_name
    prompt = "A long shared prefix, repeated to fill many pages of KV. " * 4  # 1 + 228 tokens
    first = client.completions.create(model=model, prompt=prompt, max_tokens=2)
    assert first.usage is not None and first.usage.prompt_tokens == 1 + len(prompt)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the prefill rank's KV events reach the router
        if any(r.indexed_blocks >= 20 for g in _status(served).groups for r in g.ranks):
            break
        time.sleep(0.05)
    second = client.completions.create(model=model, prompt=prompt, max_tokens=2)
    assert second.usage is not None and second.usage.prompt_tokens_details is not None
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert cached is not None and 20 * PAGE <= cached < second.usage.prompt_tokens


def test_guidellms_stream_shape_gets_the_usage_on_every_chunk(served: Served) -> None:
    """guidellm streams with ``stream_options: {include_usage, continuous_usage_stats}``: every
    chunk carries the usage so far (completion tokens rising to the total), the finishing chunk
    and the usage chunk the whole request's; the text is what the same request gives whole."""
    client, model = served.client(), served.server.model_name
    args: dict[str, Any] = {"model": model, "prompt": "Once upon a time", "max_tokens": 8, "seed": 5}
    whole = client.completions.create(**args, extra_body={"ignore_eos": True})
    chunks = list(
        client.completions.create(
            **args,
            stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},  # type: ignore[typeddict-unknown-key]
            extra_body={"ignore_eos": True},
        )
    )
    assert all(c.usage is not None for c in chunks)
    done = [c.usage.completion_tokens for c in chunks if c.usage is not None]
    assert done == sorted(done) and done[-1] == 8 and done[0] < 8
    assert all(c.usage is not None and c.usage.prompt_tokens == 17 for c in chunks)
    assert chunks[-1].choices == [] and chunks[-2].choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in chunks[:-1]) == whole.choices[0].text


def test_the_official_clients_fields_that_change_nothing_are_accepted(served: Served) -> None:
    """``store``, ``metadata``, ``service_tier``, ``user``, ``parallel_tool_calls`` through the
    official client: the same tokens as without them; ``models.retrieve`` answers the card, and
    the ``X-Request-Id`` a client sends comes back."""
    client, model = served.client(), served.server.model_name
    messages = [{"role": "user", "content": "Hello"}]
    plain = client.chat.completions.create(model=model, messages=messages, max_tokens=6, seed=2)  # type: ignore[arg-type]
    dressed = client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=6,
        seed=2,
        store=False,
        metadata={"suite": "compat"},
        service_tier="auto",
        user="eval-bot",
        parallel_tool_calls=True,
        extra_headers={"X-Request-Id": "compat-1"},
    )
    assert dressed.headers["x-request-id"] == "compat-1"
    assert dressed.parse().choices[0].message.content == plain.choices[0].message.content
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def _counted(served: Served, name: str, **labels: str) -> float:
    text = httpx.get(served.metrics_url, timeout=30).text
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items())
    )


def test_usage_counts_under_the_client_whose_token_was_used(served: Served) -> None:
    """Two clients of the token file: each one's prompt and output tokens, and its requests,
    count under its own ``client`` label only."""
    before = {c: _counted(served, "tandem_generation_tokens_total", client=c) for c in ("alice", "bob")}
    requests = {c: _counted(served, "tandem_requests_total", client=c, code="OK") for c in ("alice", "bob")}
    bob = served.client("tok-bob")
    bob.completions.create(model=served.server.model_name, prompt="per tenant", max_tokens=5,
                           extra_body={"ignore_eos": True})  # fmt: skip
    assert _counted(served, "tandem_generation_tokens_total", client="bob") == before["bob"] + 5
    assert _counted(served, "tandem_generation_tokens_total", client="alice") == before["alice"]
    assert _counted(served, "tandem_requests_total", client="bob", code="OK") == requests["bob"] + 1
    assert _counted(served, "tandem_requests_total", client="alice", code="OK") == requests["alice"]
    assert _counted(served, "tandem_prompt_tokens_total", client="bob") > 0


def _totals(served: Served) -> dict[str, dict[str, Any]]:
    """``tandem client status``' per-client totals (over every frontend: this one), as the admin
    sees them (a client sees its own row only)."""
    options = ClientOptions(served.grpc_addr, "tok-ops")
    reply = asyncio.run(grpc_status(options))
    rows, reached, missed = asyncio.run(client_totals(options, reply))
    assert len(reached) == 1 and not missed
    return {row["client"]: row for row in rows}


def test_client_status_gives_each_clients_totals_split_cached_and_new(served: Served) -> None:
    """Each client's requests, prompt tokens (cached and new) and output tokens, as
    ``tandem client status`` shows them: a request of bob's counts for bob alone, and the same
    prompt again counts its cached pages as cached."""
    before = _totals(served)
    assert {"alice", "bob"} <= set(before)  # the token file's clients, from the start
    prompt = [7 + (i * 5) % 200 for i in range(4 * PAGE + 1)]
    bob = served.client("tok-bob")
    for _ in range(2):
        bob.completions.create(model=served.server.model_name, prompt=prompt, max_tokens=3,
                               extra_body={"ignore_eos": True})  # fmt: skip
    after = _totals(served)
    grew = {k: after["bob"][k] - before["bob"][k] for k in after["bob"] if k != "client"}
    assert grew["requests"] == 2 and grew["output_tokens"] == 6
    assert grew["prompt_tokens"] == 2 * len(prompt)
    assert grew["cached_prompt_tokens"] >= 4 * PAGE  # the second found the first's pages
    assert grew["new_prompt_tokens"] + grew["cached_prompt_tokens"] == grew["prompt_tokens"]
    assert after["alice"] == before["alice"]


def test_cache_salts_keep_clients_prefixes_apart(served: Served) -> None:
    """Two clients with different salts share no cached tokens, the same salt shares them; a
    request without a salt uses its client's default: private to it, or the token file's shared
    one. A client's status shows its own usage alone."""
    model = served.server.model_name
    clients = {name: served.client(f"tok-{name}") for name in ("bob", "carol", "dave")}
    clients["alice"] = served.client()

    def cached(client: str, prompt: list[int], salt: str | None = None) -> int:
        extra = {"cache_salt": salt} if salt is not None else {}
        reply = clients[client].completions.create(model=model, prompt=prompt, max_tokens=1, extra_body=extra)
        assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
        return reply.usage.prompt_tokens_details.cached_tokens or 0

    def prompt(seed: int) -> list[int]:  # 4 full pages + 1: a hit finds 4 pages
        return [1 + (seed * 53 + i * 29) % 250 for i in range(4 * PAGE + 1)]

    sent = prompt(1)
    assert cached("alice", sent, "salt-1") == 0
    assert cached("bob", sent, "salt-2") == 0  # different salts: nothing shared
    assert cached("bob", sent, "salt-1") == 4 * PAGE  # the same salt: shared, across clients
    assert cached("bob", sent) == 0  # bob's default is not the salt he sent

    sent = prompt(2)
    assert cached("alice", sent) == 0
    assert cached("bob", sent) == 0  # each client's default is private
    assert cached("alice", sent) == 4 * PAGE  # alice's requests without a salt share her default
    assert cached("carol", sent) == 0

    sent = prompt(3)
    assert cached("carol", sent) == 0
    assert cached("dave", sent) == 4 * PAGE  # the token file's shared salt

    with grpc.insecure_channel(served.grpc_addr) as channel:
        stub = tandem_pb2_grpc.TandemStub(channel)
        mine = stub.ClusterStatus(tandem_pb2.ClusterStatusRequest(), metadata=AUTH, timeout=30)
    assert [c.client for c in mine.clients] == ["alice"]


def test_errors_in_openais_shape(served: Served) -> None:
    client, model = served.client(), served.server.model_name
    with pytest.raises(openai.BadRequestError) as bad_n:
        client.completions.create(model=model, prompt="x", n=17)
    assert bad_n.value.status_code == 400 and bad_n.value.param == "n"
    with pytest.raises(openai.NotFoundError) as unknown:
        client.completions.create(model="gpt-4", prompt="x")
    assert unknown.value.code == "model_not_found" and unknown.value.param == "model"
    with pytest.raises(openai.BadRequestError) as bad_max:
        client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}], max_tokens=0)
    assert bad_max.value.param == "max_tokens"
    with pytest.raises(openai.BadRequestError) as unsupported:
        client.completions.create(model=model, prompt="x", logprobs=21)
    assert unsupported.value.param == "logprobs"
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    not_json = httpx.post(f"{served.base_url}/completions", content=b"{oops", headers=headers, timeout=30)
    assert not_json.status_code == 400
    assert not_json.json()["error"]["type"] == "invalid_request_error"
    no_route = httpx.post(f"{served.base_url}/embeddings", json={}, headers=headers, timeout=30)
    assert no_route.status_code == 404 and set(no_route.json()["error"]) == {
        "message",
        "type",
        "param",
        "code",
    }


def test_a_wrong_or_missing_token_is_refused(served: Served) -> None:
    model = served.server.model_name
    with pytest.raises(openai.AuthenticationError):
        served.client("not-a-token").completions.create(model=model, prompt="x", max_tokens=1)
    missing = httpx.post(f"{served.base_url}/completions", json={"model": model, "prompt": "x"}, timeout=30)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "invalid_api_key"
    # bob's token is as good as alice's
    reply = served.client("tok-bob").completions.create(model=model, prompt="x", max_tokens=1)
    assert reply.usage is not None and reply.usage.completion_tokens == 1


def test_a_client_that_goes_away_mid_stream_frees_the_pages(served: Served) -> None:
    client, model = served.client(), served.server.model_name
    cancelled = _requests_counted(served, "abort", "CANCELLED")
    stream = client.completions.create(
        model=model, prompt="Keep going", max_tokens=1500, stream=True, extra_body={"ignore_eos": True}
    )
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    stream.close()
    # the frontend saw the client go and aborted the request on its decode rank
    deadline = time.monotonic() + 60
    while _requests_counted(served, "abort", "CANCELLED") == cancelled and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _requests_counted(served, "abort", "CANCELLED") == cancelled + 1
    _wait_all_pages_free(served)


def test_the_same_seed_gives_the_grpc_paths_tokens(served: Served) -> None:
    model, prompt = served.server.model_name, "Same tokens on both edges"
    sampling = SamplingParams(max_tokens=12, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    options = ClientOptions(served.grpc_addr, TOKEN, timeout_s=120)
    (outcome,) = asyncio.run(generate_all(options, [PromptSpec(prompt, None, sampling)], 1))
    assert outcome.summary is not None
    grpc_tokens = list(outcome.summary.token_ids)
    reply = served.client().completions.create(
        model=model,
        prompt=prompt,
        max_tokens=12,
        temperature=0.8,
        top_p=0.95,
        seed=1234,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )
    assert reply.choices[0].model_extra["token_ids"] == grpc_tokens  # type: ignore[index]
    other_seed = served.client().completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0.8, top_p=0.95, seed=1235,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert other_seed.choices[0].model_extra["token_ids"] != grpc_tokens  # type: ignore[index]


def test_penalties_through_prefill_and_decode_give_the_colocated_engines_tokens(
    served: Served, tiny_dir: Path
) -> None:
    """A seeded, sampled request with all four penalties and min-p: the prefill rank draws the
    first token (the repetition penalty over the prompt), the decode rank the rest (over the
    outputs as they come); over HTTP and gRPC the tokens are the colocated engine's, and not
    those of the same request without penalties."""
    import torch

    from tandem.engine.colocated import ColocatedEngine
    from tandem.engine.engine_config import EngineConfig
    from tandem.model.checkpoint import load_checkpoint
    from tandem.model.config import ModelConfig
    from tandem.model.deepseek import DeepseekV3

    prompt = [5, 9, 9, 17, 33, 9, 40, 41, 42, 9, 12, 13]
    penalties = {"presence_penalty": 0.6, "frequency_penalty": 0.9, "repetition_penalty": 1.4, "min_p": 0.05}
    sampling = SamplingParams(max_tokens=16, temperature=0.9, seed=77, ignore_eos=True, **penalties)
    cfg = ModelConfig.from_dir(tiny_dir)
    model = DeepseekV3(cfg, torch.float64)
    model.load_weights(load_checkpoint(tiny_dir, cfg, torch.float64))
    (reference,) = ColocatedEngine(model, EngineConfig(page_size=PAGE, num_pages=64)).generate(
        [prompt], sampling
    )
    reply = served.client().completions.create(
        model=served.server.model_name,
        prompt=prompt,
        max_tokens=16,
        temperature=0.9,
        seed=77,
        presence_penalty=0.6,
        frequency_penalty=0.9,
        extra_body={"ignore_eos": True, "return_token_ids": True, "repetition_penalty": 1.4, "min_p": 0.05},
    )
    assert reply.choices[0].model_extra["token_ids"] == reference.token_ids  # type: ignore[index]
    options = ClientOptions(served.grpc_addr, TOKEN, timeout_s=120)
    (outcome,) = asyncio.run(generate_all(options, [PromptSpec(None, prompt, sampling)], 1))
    assert outcome.summary is not None and list(outcome.summary.token_ids) == reference.token_ids
    plain = SamplingParams(max_tokens=16, temperature=0.9, seed=77, ignore_eos=True)
    (unpenalized,) = asyncio.run(generate_all(options, [PromptSpec(None, prompt, plain)], 1))
    assert unpenalized.summary is not None and list(unpenalized.summary.token_ids) != reference.token_ids


def test_a_client_that_goes_away_before_a_whole_response_frees_the_pages(served: Served) -> None:
    model = served.server.model_name
    cancelled = _requests_counted(served, "abort", "CANCELLED")
    body = json.dumps(
        {"model": model, "prompt": "Wait for all of it", "max_tokens": 1500, "ignore_eos": True}
    )
    host, port = served.server.http_address.rsplit(":", 1)  # type: ignore[union-attr]
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        request = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
        )
        sock.sendall(request.encode())
        deadline = time.monotonic() + 60
        while _status(served).running_requests == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _status(served).running_requests == 1  # it runs on the ranks; its client now leaves
    deadline = time.monotonic() + 60
    while _requests_counted(served, "abort", "CANCELLED") == cancelled and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _requests_counted(served, "abort", "CANCELLED") == cancelled + 1
    _wait_all_pages_free(served)


def test_a_chunked_body_over_the_limit_is_refused_before_it_ends(served: Served) -> None:
    """A body with no Content-Length (chunked) is counted as it arrives: once it passes
    ``max_request_bytes`` the server answers 413 while the client still holds the rest back,
    and the refusal is counted; a body nested too deeply for the parser is a 400, not a 500."""
    limit = EdgeLimits().max_request_bytes
    refused = _requests_counted(served, "rejected", "RESOURCE_EXHAUSTED")
    host, port = served.server.http_address.rsplit(":", 1)  # type: ignore[union-attr]
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {TOKEN}\r\n"
            "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
        )
        part = b"[" + b" " * limit  # one byte past the limit, and no end of the body yet
        sock.sendall(head.encode() + f"{len(part):x}\r\n".encode() + part + b"\r\n")
        reply = sock.recv(65536)  # the last chunk is never sent: only a refusal at the limit answers
    assert reply.startswith(b"HTTP/1.1 413"), reply[:200]
    assert _requests_counted(served, "rejected", "RESOURCE_EXHAUSTED") == refused + 1
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    invalid = _requests_counted(served, "rejected", "INVALID_ARGUMENT")
    deep = httpx.post(
        f"{served.base_url}/completions", content=b"[" * 1000 + b"]" * 1000, headers=headers, timeout=30
    )
    assert deep.status_code == 400 and "nests deeper than 64 levels" in deep.json()["error"]["message"]
    schema = httpx.post(f"{served.base_url}/completions", json={"prompt": 5}, headers=headers, timeout=30)
    assert schema.status_code == 400  # a field of the wrong type, refused by the schema
    assert _requests_counted(served, "rejected", "INVALID_ARGUMENT") == invalid + 2


# ---- fuzz ---------------------------------------------------------------------------------
JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
SERVED = "$served"  # the served model's name, filled in when a body is sent
# each field's values: ones the server takes, and anything JSON carries
FIELDS: dict[str, tuple[Any, Any]] = {
    "model": (st.just(SERVED), st.text(max_size=20) | JSON),
    "prompt": (st.text(min_size=1, max_size=40) | st.lists(st.integers(0, 257), min_size=1, max_size=20),
               JSON | st.lists(st.integers(-(2**40), 2**40), max_size=30)),
    "max_tokens": (st.integers(1, 3), st.integers(-(2**63), 2**63) | JSON),
    "temperature": (st.floats(0, 2), st.floats() | JSON),
    "top_p": (st.floats(0.01, 1), st.floats() | JSON),
    "seed": (st.integers(0, 2**63 - 1), st.integers() | JSON),
    "stop": (st.lists(st.text(min_size=1, max_size=4), max_size=3), JSON),
    "stream": (st.booleans(), JSON),
    "stream_options": (st.just({"include_usage": True, "continuous_usage_stats": True}), JSON),
    "n": (st.just(1), JSON),
    "logprobs": (st.none(), JSON),
    "metadata": (st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=3), JSON),
    "made_up": (st.nothing(), JSON),
}  # fmt: skip


@st.composite
def _bodies(draw: Any) -> dict[str, Any] | bytes:
    """A request body: valid fields but for a few drawn wild, or bytes that may not be JSON."""
    if draw(st.integers(0, 9)) == 0:
        return bytes(draw(st.binary(max_size=80)))
    wild = draw(st.sets(st.sampled_from(list(FIELDS)), max_size=3))
    body = {}
    for name, (valid, anything) in FIELDS.items():
        if name in wild:
            body[name] = draw(anything)
        elif name in ("model", "prompt", "max_tokens") or (name != "made_up" and draw(st.booleans())):
            body[name] = draw(valid)
    if body.get("stream") is not True and "stream_options" not in wild:
        body.pop("stream_options", None)
    return body


def test_fuzzed_http_requests_get_a_4xx_or_a_response_and_the_server_keeps_serving(served: Served) -> None:
    """Drawn bodies, content types and routes: every answer is a 200 (whole or streamed) or a
    4xx in OpenAI's shape, never a 5xx; afterwards every page is free and a plain request gets
    the tokens it got before."""
    model = served.server.model_name
    client = served.client()
    args: dict[str, Any] = {"model": model, "prompt": "after the fuzz", "max_tokens": 6, "seed": 9}
    before = client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text
    outcomes: dict[int, int] = {}
    http = httpx.Client(base_url=served.base_url, timeout=60)

    @settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(
        body=_bodies(),
        kind=st.sampled_from(["application/json", "application/json; charset=utf-8", "text/plain", None]),
        route=st.sampled_from(["/completions", "/chat/completions"]),
    )
    def one(body: dict[str, Any] | bytes, kind: str | None, route: str) -> None:
        headers = {"Authorization": f"Bearer {TOKEN}", **({"Content-Type": kind} if kind else {})}
        if isinstance(body, dict):
            if route == "/chat/completions" and "prompt" in body:
                prompt = body.pop("prompt")
                body["messages"] = [{"role": "user", "content": prompt if isinstance(prompt, str) else "hi"}]
            body = json.dumps({**body, "model": model} if body.get("model") == SERVED else body).encode()
        reply = http.post(route, content=body, headers=headers)
        outcomes[reply.status_code] = outcomes.get(reply.status_code, 0) + 1
        assert reply.status_code == 200 or 400 <= reply.status_code < 500, (
            body,
            reply.status_code,
            reply.text,
        )
        if reply.status_code != 200:
            assert set(reply.json()["error"]) == {"message", "type", "param", "code"}
        assert reply.headers["x-request-id"]

    try:
        one()
    finally:
        http.close()
    assert outcomes.get(200, 0) > 0 and outcomes.get(400, 0) > 0 and outcomes.get(415, 0) > 0, outcomes
    _wait_all_pages_free(served)
    assert client.completions.create(**args, extra_body={"ignore_eos": True}).choices[0].text == before


@pytest.fixture(scope="module")
def reference_logprobs(tiny_dir: Path) -> Any:
    """``transformers``' log-softmax (float64) of every position of a sequence."""
    import torch
    from transformers import DeepseekV3ForCausalLM

    hf = DeepseekV3ForCausalLM.from_pretrained(tiny_dir, dtype=torch.float64)
    hf.config._attn_implementation = "sdpa"
    hf.config._experts_implementation = "eager"

    def of(tokens: list[int]) -> Any:
        with torch.no_grad():
            return torch.log_softmax(hf(torch.tensor([tokens])).logits[0], dim=-1)

    return of


def test_logprobs_over_http_and_grpc_are_the_references_log_softmax(
    served: Served, reference_logprobs: Any
) -> None:
    """Output logprobs (sampled at temperature 1: the values are the model's, before sampling
    adjustments) and an echoed prompt's, through prefill and decode ranks, equal ``transformers``'
    log-softmax within 1e-4, for a prompt whose prefix the prefill rank had cached (recomputed:
    its usage shows no cached tokens). The completion's ``top_logprobs`` hold the token and its
    k likeliest; chat's ``top_logprobs`` the k likeliest; gRPC's the same values."""
    model, client = served.server.model_name, served.client()
    prefix = [7 + (i * 37) % 200 for i in range(3 * PAGE)]
    prompt = [*prefix, 11, 22, 33]
    warm = client.completions.create(model=model, prompt=[*prefix, 44], max_tokens=2)
    assert warm.usage is not None
    again = client.completions.create(model=model, prompt=[*prefix, 55], max_tokens=2)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 2 * PAGE  # the prefix is cached
    reply = client.completions.create(
        model=model, prompt=prompt, max_tokens=6, temperature=1.0, seed=3, logprobs=3, echo=True,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    choice = reply.choices[0]
    outputs = choice.model_extra["token_ids"]  # type: ignore[index]
    assert reply.usage is not None and reply.usage.prompt_tokens_details is not None
    assert reply.usage.prompt_tokens_details.cached_tokens == 0
    ref = reference_logprobs(prompt + outputs)
    lp = choice.logprobs
    assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
    assert len(lp.token_logprobs) == len(prompt) + len(outputs) and lp.token_logprobs[0] is None
    tokens = prompt + outputs
    for i in range(1, len(tokens)):
        expected = ref[i - 1]
        assert abs(lp.token_logprobs[i] - expected[tokens[i]].item()) < 1e-4, i
        top = lp.top_logprobs[i]
        values = sorted(top.values(), reverse=True)
        best = expected.topk(3).values.tolist()
        assert abs(max(values) - best[0]) < 1e-4 and len(top) in (3, 4), i
        assert min(abs(lp.token_logprobs[i] - v) for v in values) < 1e-12  # its own entry is there
    # chat: the output's logprobs and the k likeliest of each
    chat = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "logprobs please"}], max_tokens=5,
        temperature=1.0, seed=4, logprobs=True, top_logprobs=2,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    content = chat.choices[0].logprobs
    assert content is not None and content.content is not None and len(content.content) == 5
    assert all(len(entry.top_logprobs) == 2 for entry in content.content)
    # gRPC: the chunks' output logprobs and the summary's prompt logprobs, the same values
    sampling = SamplingParams(
        max_tokens=6, temperature=1.0, seed=3, ignore_eos=True, logprobs=3, prompt_logprobs=2
    )
    options = ClientOptions(served.grpc_addr, TOKEN, timeout_s=120)
    (outcome,) = asyncio.run(generate_all(options, [PromptSpec(None, prompt, sampling)], 1))
    assert outcome.summary is not None and list(outcome.summary.token_ids) == outputs
    entries = [e for chunk in outcome.chunks for e in chunk.logprobs]
    assert [e.token_id for e in entries] == outputs
    for j, entry in enumerate(entries):
        row = ref[len(prompt) - 1 + j]
        assert abs(entry.logprob - row[outputs[j]].item()) < 1e-4
        assert list(entry.top_token_ids) == row.topk(3).indices.tolist()
        assert abs(entry.logprob - lp.token_logprobs[len(prompt) + j]) < 1e-12  # HTTP's, exactly
    prompt_entries = outcome.summary.prompt_logprobs
    assert [e.token_id for e in prompt_entries] == prompt[1:]
    for i, entry in enumerate(prompt_entries, start=1):
        assert abs(entry.logprob - ref[i - 1][prompt[i]].item()) < 1e-4
        assert len(entry.top_token_ids) == 2
    _wait_all_pages_free(served)


def test_lm_evals_loglikelihood_shapes_are_served(served: Served) -> None:
    """What lm-eval's ``local-completions`` sends for a loglikelihood request: token ids in a
    list, ``max_tokens: 1``, ``logprobs: 1``, ``echo``, temperature 0; every prompt token's
    logprob then the generated one's, each ``top_logprobs`` map holding the token itself (so
    lm-eval's greedy check compares equal values). ``max_tokens: 0`` gives the prompt alone;
    streamed, the same values come in the chunks."""
    model = served.server.model_name
    prompt = [256, *range(40, 60)]
    body = {"model": model, "prompt": [prompt], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}  # fmt: skip
    headers = {"Authorization": f"Bearer {TOKEN}"}
    with httpx.Client(base_url=served.base_url, headers=headers, timeout=120) as http:
        reply = http.post("/completions", json=body)
        assert reply.status_code == 200, reply.text
        (choice,) = reply.json()["choices"]
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(prompt) + 1 and lp["token_logprobs"][0] is None
        assert lp["top_logprobs"][0] is None
        for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:], strict=True):
            assert value in top.values() and 1 <= len(top) <= 2
        greedy = lp["token_logprobs"][-1]  # temperature 0: the generated token is the likeliest
        assert greedy == max(lp["top_logprobs"][-1].values())
        assert lp["text_offset"] == sorted(lp["text_offset"])
        only = http.post("/completions", json={**body, "max_tokens": 0}).json()
        assert only["usage"]["completion_tokens"] == 0
        assert only["choices"][0]["logprobs"]["token_logprobs"] == lp["token_logprobs"][:-1]
        streamed: list[Any] = []
        with http.stream("POST", "/completions", json={**body, "stream": True}) as events:
            for line in events.iter_lines():
                if line.startswith("data: {"):
                    for c in json.loads(line[6:])["choices"]:
                        if c["logprobs"] is not None:
                            streamed += c["logprobs"]["token_logprobs"]
        assert streamed == lp["token_logprobs"]
        bad = http.post("/completions", json={**body, "logprobs": 21})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "logprobs"
        chat_bad = http.post(
            "/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
        )
        assert chat_bad.status_code == 400 and chat_bad.json()["error"]["param"] == "top_logprobs"
    _wait_all_pages_free(served)


def _prefill_queried_tokens(served: Served) -> int:
    """Prompt tokens the prefill ranks looked up in their caches: one a prompt a prefill job."""
    return sum(
        r.prefix_queried_tokens for g in _status(served).groups if g.role == "prefill" for r in g.ranks
    )


def test_choices_fork_from_the_first_on_its_decode_rank(served: Served) -> None:
    """``n=3`` while the first choice runs: the other two go to its decode rank and start on its
    prompt's KV there (no prefill job, no transfer: the prefill rank looks up one prompt), each
    billed its prompt as cached but the last token, which it recomputes to draw its first."""
    model, client = served.server.model_name, served.client()
    prompt = [9 + (i * 7) % 150 for i in range(3 * PAGE + 5)]
    queried = _prefill_queried_tokens(served)
    reply = client.completions.create(  # type: ignore[call-overload]
        model=model, prompt=prompt, n=3, seed=3, max_tokens=160, temperature=1.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert [len(c.model_extra["token_ids"]) for c in reply.choices] == [160] * 3  # type: ignore[index]
    assert _prefill_queried_tokens(served) - queried == len(prompt)  # one prefill job
    alone = client.completions.create(  # type: ignore[call-overload]
        model=model, prompt=prompt, seed=5, max_tokens=160, temperature=1.0,
        extra_body={"ignore_eos": True, "return_token_ids": True},
    )  # fmt: skip
    assert alone.choices[0].model_extra["token_ids"] == reply.choices[2].model_extra["token_ids"]  # type: ignore[index]
    ranks = [r for g in _status(served).groups for r in g.ranks]
    assert ranks and all(r.integrity == "ok" for r in ranks), [(r.name, r.integrity) for r in ranks]


def test_logit_bias_forces_and_bans_tokens_on_both_edges(served: Served) -> None:
    """A +100 bias makes every greedy output that token (the prefill rank's first and the decode
    rank's rest); -100 on the token a request gives unbiased keeps it out; gRPC's map gives the
    same tokens; an id outside the vocabulary is a 400 naming logit_bias."""
    model, client = served.server.model_name, served.client()
    prompt = [5, 9, 17, 33, 40, 41, 42, 12]

    def tokens(bias: dict[str, float]) -> list[int]:
        reply = client.completions.create(
            model=model, prompt=prompt, max_tokens=6, temperature=0, logit_bias=bias,  # type: ignore[arg-type]
            extra_body={"ignore_eos": True, "return_token_ids": True},
        )  # fmt: skip
        return list(reply.choices[0].model_extra["token_ids"])  # type: ignore[index]

    assert tokens({"77": 100}) == [77] * 6
    plain = tokens({})
    banned = tokens({str(t): -100 for t in set(plain)})
    assert not set(banned) & set(plain)
    sampling = SamplingParams(max_tokens=6, ignore_eos=True, logit_bias=((77, 100.0),))
    options = ClientOptions(served.grpc_addr, TOKEN, timeout_s=120)
    (outcome,) = asyncio.run(generate_all(options, [PromptSpec(None, prompt, sampling)], 1))
    assert outcome.summary is not None and list(outcome.summary.token_ids) == [77] * 6
    with pytest.raises(openai.BadRequestError) as refused:
        tokens({"100000": 5})
    assert refused.value.body["param"] == "logit_bias"  # type: ignore[index]
    _wait_all_pages_free(served)


def test_n_choices_are_the_requests_sent_one_by_one_with_their_seeds(served: Served) -> None:
    """``n=3`` with a seed: three choices, each the request sent alone with the seed plus its
    index; the prompt counted once in the usage, every choice's tokens counted; the later
    choices find the prompt's KV cached (on the decode rank, forked from the first, or in the
    prefill rank's cache when the first ended before they came). ``best_of=3, n=1`` returns the one of
    highest cumulative logprob; streamed, each choice's chunks carry its index and one usage
    ends the stream."""
    model, client = served.server.model_name, served.client()
    prompt = [5 + (i * 13) % 150 for i in range(3 * PAGE + 3)]
    fields = {
        "max_tokens": 6,
        "temperature": 1.0,
        "extra_body": {"ignore_eos": True, "return_token_ids": True},
    }
    cached_before = _counted(served, "tandem_cached_prompt_tokens_total")
    reply = client.completions.create(model=model, prompt=prompt, n=3, seed=41, **fields)  # type: ignore[call-overload]
    assert [c.index for c in reply.choices] == [0, 1, 2] and reply.usage is not None
    # choices 1 and 2 went once choice 0's prompt was computed: its 3 full pages were cached
    assert _counted(served, "tandem_cached_prompt_tokens_total") - cached_before >= 2 * 3 * PAGE
    together = [c.model_extra["token_ids"] for c in reply.choices]  # type: ignore[index]
    alone = []
    for i in range(3):
        one = client.completions.create(model=model, prompt=prompt, seed=41 + i, **fields)  # type: ignore[call-overload]
        alone.append(one.choices[0].model_extra["token_ids"])  # type: ignore[index]
    assert together == alone and len({tuple(t) for t in together}) > 1
    assert reply.usage.prompt_tokens == len(prompt) and reply.usage.completion_tokens == 18
    # the best of three by cumulative logprob, scored with the logprobs it did not ask for
    best = client.completions.create(model=model, prompt=prompt, n=1, best_of=3, seed=41, **fields)  # type: ignore[call-overload]
    (choice,) = best.choices
    assert choice.logprobs is None and best.usage is not None and best.usage.completion_tokens == 18
    scored = client.completions.create(model=model, prompt=prompt, n=3, seed=41, logprobs=0, **fields)  # type: ignore[call-overload]
    sums = [sum(c.logprobs.token_logprobs) for c in scored.choices]  # type: ignore[union-attr, arg-type]
    assert choice.model_extra["token_ids"] == together[sums.index(max(sums))]  # type: ignore[index]
    # streamed chat: each choice's deltas by index, then one usage for all
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "two ways"}], n=2, seed=7, max_tokens=4,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    finished, usages = set(), []
    for chunk in stream:
        for c in chunk.choices:
            if c.finish_reason is not None:
                finished.add(c.index)
        if chunk.usage is not None:
            usages.append(chunk.usage)
    assert finished == {0, 1} and len(usages) == 1 and usages[0].completion_tokens == 8
    _wait_all_pages_free(served)
