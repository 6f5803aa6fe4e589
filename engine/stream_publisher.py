"""A rank's streams to its frontends: each step's new tokens, in columns, and the results of the
requests that ended, gathered per frontend and pushed as one ``StreamBatch`` a frontend at the
end of each loop iteration (``publish``). A request no frontend streams (a group driven directly:
``tandem generate --dep``) has its result kept for ``take_results``. The decode and colocated
workers both stream through one of these."""

from __future__ import annotations

from collections.abc import Sequence

from tandem.engine.outbox import Outbox
from tandem.wire.logprobs import TokenLogprobs
from tandem.wire.messages import RankId, RequestResult, StreamBatch, StreamColumns


class StreamPublisher:
    def __init__(self, rank_id: RankId) -> None:
        self.rank_id = rank_id
        self._pushes: dict[str, tuple[StreamColumns, list[RequestResult]]] = {}
        self._results: list[RequestResult] = []

    def tokens(
        self,
        frontend: str,
        request_id: str,
        start_index: int,
        token_ids: tuple[int, ...],
        times_s: Sequence[float],
        unix_s: float,
        logprobs: Sequence[TokenLogprobs | None] = (),
        prompt_logprobs: Sequence[TokenLogprobs | None] = (),
    ) -> None:
        """Output tokens ``start_index`` onwards of a request, each known at ``times_s`` (this
        rank's monotonic clock), all in a step that ended at ``unix_s``; their ``logprobs``
        when the request asked, and with its first tokens its prompt's."""
        columns = self._pushes.setdefault(frontend, (StreamColumns(), []))[0]
        if prompt_logprobs:
            columns.prompt_logprobs.append((request_id, tuple(prompt_logprobs)))
        columns.add(request_id, start_index, token_ids, tuple(times_s), (unix_s,) * len(token_ids), logprobs)

    def result(self, frontend: str | None, result: RequestResult) -> None:
        """How a request ended: pushed to its frontend, or kept for ``take_results``."""
        if frontend is None:
            self._results.append(result)
        else:
            self._pushes.setdefault(frontend, (StreamColumns(), []))[1].append(result)

    def take_results(self) -> list[RequestResult]:
        out, self._results = self._results, []
        return out

    def take_pushes(self) -> dict[str, StreamBatch]:
        """The tokens and results gathered since the last call, one batch a frontend."""
        pushes, self._pushes = self._pushes, {}
        return {
            frontend: columns.batch(self.rank_id, tuple(results))
            for frontend, (columns, results) in pushes.items()
        }

    def publish(self, outbox: Outbox) -> list[str]:
        """Push each frontend its batch; the frontends that are gone (their requests must end)."""
        gone = [
            frontend
            for frontend, batch in self.take_pushes().items()
            if not outbox.push_stream(frontend, batch)
        ]
        return gone + outbox.flush()
