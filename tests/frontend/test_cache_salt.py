"""A request's cache salt at the frontend: both edges take it (gRPC's ``cache_salt`` field,
vLLM's ``cache_salt`` on completions and chat), an authenticated client without one gets its
default from the token file (private unless the file names a shared one), and the router looks
the prompt up by the salted chain, which the request carries to its ranks."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import pytest

from tandem.engine.prefix_cache import block_hashes, chain_root
from tandem.frontend.cache_salt import MAX_CACHE_SALT_CHARS
from tandem.frontend.chat_template import ChatTemplate
from tandem.frontend.core import FrontendConfig, FrontendCore
from tandem.frontend.grpc_service import TandemServicer
from tandem.frontend.openai_protocol import (
    ChatRequest,
    CompletionRequest,
    OpenAIError,
    ServedModel,
    parse_request,
    prepare_chat,
    prepare_completion,
)
from tandem.frontend.running import GenerateSpec
from tandem.model.tokenizer import Tokenizer
from tandem.protos import tandem_pb2
from tandem.wire.kv_events import BlockStored
from tandem.wire.messages import RankId, RankRequest, Role
from tandem.wire.request_params import InvalidRequestError, SamplingParams
from tandem.wire.routing_view import GroupView, RoutingView

PREFILL, DECODE = RankId("prefill0", 0), RankId("decode0", 0)
PAGE = 16
PROMPT = [5 + i % 200 for i in range(2 * PAGE + 1)]
TOKENS = (
    "alice:tok-a\n"
    "bob:tok-b\n"
    "# these two share a system prompt's pages\n"
    "carol:tok-c cache_salt=team-7\n"
    "dave:tok-d  cache_salt=team-7 admin\n"
)


class _Rank:
    """A decode rank's channel that keeps what it is sent."""

    def __init__(self) -> None:
        self.held: list[RankRequest] = []
        self.is_open = True

    def submit(self, requests: list[RankRequest]) -> asyncio.Future[None]:
        self.held += requests
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        future.set_result(None)
        return future

    def abort(self, request_ids: list[str]) -> None:
        pass


def _ready_core(tiny_dir: Path, auth_token: str | None) -> tuple[FrontendCore, _Rank]:
    core = FrontendCore(FrontendConfig(str(tiny_dir), "tiny", metrics=False, auth_token=auth_token))
    rank = _Rank()
    core.membership.view = RoutingView(
        prefill={PREFILL: object()},
        decode={DECODE: object()},
        groups=(
            GroupView("prefill0", Role.PREFILL, "ready", 1, (PREFILL,)),
            GroupView("decode0", Role.DECODE, "ready", 1, (DECODE,)),
        ),
        page_size=PAGE,
        prefill_capacity_tokens=4096,
        decode_capacity_tokens=4096,
    )
    core.ready = True
    core.membership.incarnations = {PREFILL: 1, DECODE: 1}
    core.membership.channels[(DECODE, 1)] = rank  # type: ignore[assignment]
    core.router.set_ranks([PREFILL], [DECODE])
    core.router.update_decode_stats(DECODE, 256, 0, 256)
    return core, rank


def _routed(core: FrontendCore, rank: _Rank, client: str, salt: str | None = None) -> tuple[str | None, int]:
    """Send one request; the salt its rank request carries and the cached tokens the router
    predicted for it."""

    async def run() -> tuple[str | None, int]:
        spec = GenerateSpec(
            f"r{len(rank.held)}", PROMPT, SamplingParams(max_tokens=2), client=client, cache_salt=salt
        )
        stream = core.generate(spec)
        first = asyncio.ensure_future(anext(stream))
        while not rank.held or rank.held[-1].request_id.split("@")[0] != spec.request_id:
            await asyncio.sleep(0)
        route = next(r for r in core.running.values() if r.spec.request_id == spec.request_id).stream.route
        assert route is not None
        first.cancel()  # the client goes away: its stream ends (and aborts the request)
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await stream.aclose()
        return rank.held[-1].cache_salt, route.predicted_cached_tokens

    return asyncio.run(run())


def test_each_authenticated_client_has_its_own_default_salt_unless_the_file_shares_one(
    tiny_dir: Path,
) -> None:
    core, rank = _ready_core(tiny_dir, TOKENS)
    salts = {client: _routed(core, rank, client)[0] for client in ("alice", "bob", "carol", "dave")}
    assert None not in salts.values()
    assert salts["carol"] == salts["dave"]  # the file's shared salt
    assert len({salts["alice"], salts["bob"], salts["carol"]}) == 3  # private by default
    given = {client: _routed(core, rank, client, "shared-doc")[0] for client in ("alice", "bob")}
    assert given["alice"] == given["bob"] and given["alice"] not in salts.values()  # a salt sent is the salt
    assert _routed(core, rank, "carol", "team-7")[0] != salts["carol"]  # no way into the file's by guessing


def test_without_auth_and_without_a_salt_the_chain_is_todays(tiny_dir: Path) -> None:
    core, rank = _ready_core(tiny_dir, None)
    assert _routed(core, rank, "")[0] is None
    assert _routed(core, rank, "", "mine")[0] is not None


def test_the_router_looks_a_prompt_up_by_its_salted_chain(tiny_dir: Path) -> None:
    core, rank = _ready_core(tiny_dir, TOKENS)
    alice_salt, predicted = _routed(core, rank, "alice")
    assert predicted == 0
    # the prefill rank reports alice's prompt cached, under the chain her requests carry
    hashes = tuple(block_hashes(PROMPT, PAGE, alice_salt))
    core.router.apply_events(PREFILL, [BlockStored(hashes, chain_root(alice_salt), PAGE)])
    assert _routed(core, rank, "alice")[1] == 2 * PAGE
    assert _routed(core, rank, "bob")[1] == 0  # bob's guess of her prompt finds nothing
    assert _routed(core, rank, "carol")[1] == 0


@pytest.fixture(scope="module")
def served_model(tiny_dir: Path) -> ServedModel:
    return ServedModel("tiny", Tokenizer.from_dir(tiny_dir), 258, 512, ChatTemplate.from_dir(tiny_dir))


def _refused(call: Any) -> OpenAIError:
    with pytest.raises(OpenAIError) as info:
        call()
    return info.value


def test_the_openai_edge_takes_cache_salt_on_completions_and_chat(served_model: ServedModel) -> None:
    def completion(**body: Any) -> Any:
        request = parse_request(CompletionRequest, {"model": "tiny", "prompt": "Hello", **body})
        return prepare_completion(request, served_model, "cmpl-1", "alice")

    def chat(**body: Any) -> Any:
        messages = [{"role": "user", "content": "Hello"}]
        request = parse_request(ChatRequest, {"model": "tiny", "messages": messages, **body})
        return prepare_chat(request, served_model, "chatcmpl-1", "alice")

    assert completion(cache_salt="s-1").spec.cache_salt == "s-1"
    assert chat(cache_salt="s-1").spec.cache_salt == "s-1"
    assert completion().spec.cache_salt is None and chat().spec.cache_salt is None
    for call in (completion, chat):
        for bad in ("", "x" * (MAX_CACHE_SALT_CHARS + 1), 7, ["s"]):
            error = _refused(lambda call=call, bad=bad: call(cache_salt=bad))
            assert (error.status, error.param) == (400, "cache_salt"), bad


def test_the_grpc_edge_takes_cache_salt(tiny_dir: Path) -> None:
    core = FrontendCore(FrontendConfig(str(tiny_dir), "tiny", metrics=False))
    servicer = TandemServicer(core)

    def spec(**fields: Any) -> GenerateSpec:
        message = tandem_pb2.GenerateRequest(
            token_ids={"ids": [1, 2, 3]}, sampling=tandem_pb2.SamplingParams(max_tokens=2), **fields
        )
        return asyncio.run(servicer._spec(message, 0.0, "alice"))

    assert spec(cache_salt="s-1").cache_salt == "s-1"
    assert spec().cache_salt is None
    for bad in ("", "x" * (MAX_CACHE_SALT_CHARS + 1)):
        with pytest.raises(InvalidRequestError) as info:
            spec(cache_salt=bad)
        assert info.value.field == "cache_salt"
