"""How a decode rank on Ray picks a prefill rank for a job and sends it there."""

from __future__ import annotations

import itertools
from typing import Any

import ray

from tandem.decode.worker import PrefillDispatcher
from tandem.engine.prefix_cache import block_hash, chain_root
from tandem.engine.request import Request
from tandem.wire.messages import RankId
from tandem.wire.prefill_job import PrefillJob


class NoPrefillRank(RuntimeError):
    def __init__(self, request_id: str) -> None:
        super().__init__(f"no prefill rank is known to this decode rank for request {request_id}")


class RayPrefillDispatcher(PrefillDispatcher):
    """The router's choice when it made one and the rank is known; otherwise (requests from no
    router, and retries) prefix affinity: a prompt with a full first page goes to the prefill rank
    its first block hash picks (so prompts that share a system prompt meet the same prefix
    cache); shorter prompts go round-robin. A job goes by a call that is not waited for; the
    prefill rank answers it with a call back to this rank's actor (``prefill_answers``)."""

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self.ranks: dict[RankId, Any] = {}
        self._next = itertools.count()
        self._me: Any = None  # this decode rank's actor: where the answers come back

    def set_ranks(self, ranks: dict[RankId, Any]) -> None:
        self.ranks = dict(ranks)

    def choose(self, request: Request, preferred: RankId | None = None) -> RankId:
        if preferred is not None and preferred in self.ranks:
            return preferred
        ranks = sorted(self.ranks)
        if not ranks:
            raise NoPrefillRank(request.request_id)
        prompt = request.prompt_token_ids
        if len(prompt) > self.page_size:
            return ranks[block_hash(chain_root(request.cache_salt), prompt[: self.page_size]) % len(ranks)]
        return ranks[next(self._next) % len(ranks)]

    def send(self, prefill_rank: RankId, job: PrefillJob) -> None:
        if self._me is None:
            self._me = ray.get_runtime_context().current_actor
        self.ranks[prefill_rank].submit_jobs.remote([job], self._me)
