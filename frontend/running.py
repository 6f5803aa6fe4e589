"""A request as the frontend holds it: the spec its client sent (validated), the key its client
names it by, and the record of where it runs from admission to the end of its stream."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tandem.frontend.grpc_auth import ANONYMOUS
from tandem.frontend.request_stream import RequestStream
from tandem.wire.messages import RankId
from tandem.wire.request_params import SamplingParams


@dataclass(frozen=True)
class GenerateSpec:
    """A validated request (the servicer builds it from the protobuf)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_s: float = field(default_factory=time.monotonic)  # reached the server, this process's clock
    client: str = ANONYMOUS  # whose request id it is (``grpc_auth``)
    # a choice of a request for several: the client's request id of another choice with the same
    # prompt; while that one runs, this one goes to its decode rank and shares its prompt's KV
    fork_of: str = ""
    # as the client sent it (``frontend/cache_salt.py``); None: its client's default
    cache_salt: str | None = None


@dataclass(frozen=True)
class RequestKey:
    """A running request as its client names it."""

    client: str
    request_id: str


@dataclass
class Running:
    """A request from admission to the end of its stream. ``rank_request_id`` is the id the
    ranks know it by: the client's id plus a unique suffix, so that a client may reuse an id the
    moment its stream ends while the ranks still wind the old one down (and a migrated request
    gets a new one on its new rank)."""

    stream: RequestStream
    rank_request_id: str
    decode_rank: RankId
    incarnation: int  # of the decode rank it was sent to
    channel: Any  # to the decode rank (``frontend/rank_channel.py``)
    spec: GenerateSpec  # as the client sent it, seeded (a migration resumes from it)
    submitting: bool = True
    abort_requested: bool = False
    # its decode rank failed and no other took it yet: waits for one until then (monotonic)
    parked_until: float | None = None
    parked_why: str = ""
    lost: tuple[str, int] = ("", -1)  # the group and incarnation it was lost with

    @property
    def key(self) -> RequestKey:
        return RequestKey(self.spec.client, self.spec.request_id)

    def send_abort(self) -> None:
        self.channel.abort([self.rank_request_id])
