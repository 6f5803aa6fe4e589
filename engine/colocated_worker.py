"""A colocated rank's worker: the colocated engine in the one rank loop. Requests come in as
:class:`RankRequest` and leave, finished, as :class:`RequestResult` through ``collect``."""

from __future__ import annotations

from typing import Any

from tandem.engine.colocated import ColocatedEngine
from tandem.engine.dep import ExpertParallelDispatcher
from tandem.engine.messages import Bill, LoopStats, RankId, RankRequest, RankStats, RequestResult, Role
from tandem.engine.rank_loop import RankWorker
from tandem.engine.request import FinishReason, Request


class ColocatedWorker(RankWorker):
    def __init__(
        self, rank_id: RankId, incarnation: int, engine: ColocatedEngine, dispatcher: ExpertParallelDispatcher
    ) -> None:
        self.rank_id, self.incarnation, self.name = rank_id, incarnation, rank_id.name
        self.engine = engine
        self.dispatcher = dispatcher
        self._results: list[RequestResult] = []

    def admit(self, items: list[Any]) -> list[RankRequest]:
        for r in items:
            r.sampling.validate()
            self.engine.validate_prompt(list(r.prompt_token_ids))
        return list(items)

    def submit(self, admitted: list[RankRequest]) -> None:
        for r in admitted:
            self.engine.add_request(list(r.prompt_token_ids), r.sampling, r.request_id)

    def abort(self, request_id: str) -> None:
        request = self.engine.scheduler.get_request(request_id)
        if request is not None and self.engine.abort(request_id):
            self._report([request])

    def tick(self) -> None:
        pass

    def has_work(self) -> bool:
        return self.engine.scheduler.has_unfinished_requests()

    def step(self) -> None:
        self._report(self.engine.step())

    def take_results(self) -> list[RequestResult]:
        out, self._results = self._results, []
        return out

    def fail_all(self, reason: str) -> list[RequestResult]:
        scheduler = self.engine.scheduler
        held = scheduler.unfinished_requests()
        for r in held:
            scheduler.abort_request(r.request_id)
        self._results += [self._result(r, FinishReason.ERROR, reason) for r in held]
        return self.take_results()

    def stats(self, loop: LoopStats) -> RankStats:
        scheduler, ep = self.engine.scheduler, self.dispatcher.stats
        return RankStats(
            rank=self.rank_id,
            role=Role.COLOCATED,
            incarnation=self.incarnation,
            loop=loop,
            queued=scheduler.num_waiting,
            running=scheduler.num_running,
            free_pages=scheduler.kv_cache.num_free_pages,
            total_pages=scheduler.kv_cache.num_total_pages,
            cached_pages=scheduler.kv_cache.num_cached_pages,
            local_experts=len(self.dispatcher.local),
            forward_s=self.engine.runner.stats.forward_s,
            all_to_all_s=ep.all_to_all_s,
            moe_rows_sent=ep.rows_sent,
            moe_rows_received=ep.rows_received,
        )

    def check_integrity(self) -> None:
        self.engine.scheduler.check_integrity()

    def _report(self, finished: list[Request]) -> None:
        self._results += [self._result(r, r.finish_reason or FinishReason.ABORT) for r in finished]

    def _result(self, request: Request, reason: FinishReason, error: str | None = None) -> RequestResult:
        bill = Bill(
            prompt_tokens=request.num_prompt_tokens,
            cached_tokens=request.num_cached_tokens,
            new_prompt_tokens=request.num_prompt_tokens - request.num_cached_tokens,
            output_tokens=len(request.output_token_ids),
        )
        return RequestResult(
            request.request_id, tuple(request.output_token_ids), reason, bill, self.rank_id, error=error
        )
