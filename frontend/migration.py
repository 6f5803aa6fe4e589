"""Requests whose decode rank failed move to another: they resume there from their prompt and the
tokens their client already has (the prefill rank recomputes that KV, or finds it cached), their
stream goes on from the next token, and greedy or seeded sampling gives the tokens an undisturbed
run would (every request has a seed: ``SamplingParams.seeded``).

A decode rank is lost when it dies (its stats call fails), when the view shows its group failed
or rebuilt, or when it reports its own failure (``RequestResult.rank_failure``: its loop failed
on a collective a dead peer broke). A lost request resumes on a decode rank of another group;
where none takes work it waits (``parked_until``) ``migration_wait_s`` for one, its own group
rebuilt, and ends with the error if none comes. A request moves at most ``max_migrations``
times, and never while it is being submitted or aborted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from tandem.frontend.membership import Membership
from tandem.frontend.rank_channel import SUBMIT_ERRORS, refusal
from tandem.frontend.running import Running
from tandem.metrics.frontend import FrontendMetrics
from tandem.router.router import NoRankAvailable, Router
from tandem.wire.messages import RankId

log = logging.getLogger(__name__)

# routes and submits a running request again, resumed from tokens (``FrontendCore._send``):
# the request's record and the submit's future
Resend = Callable[[Running, tuple[int, ...]], tuple[Running, Any]]


class Migration:
    def __init__(
        self,
        router: Router[RankId],
        membership: Membership,
        resend: Resend,
        max_migrations: int,
        migration_wait_s: float,
        metrics: FrontendMetrics | None,
        tasks: set[asyncio.Future[None]],
    ) -> None:
        self.router, self.membership, self.resend = router, membership, resend
        self.max_migrations, self.migration_wait_s = max_migrations, migration_wait_s
        self.metrics, self._tasks = metrics, tasks

    def rank_lost(self, running: Running, why: str) -> None:
        """Resume the request on a decode rank of another group; where none takes work, it
        waits ``migration_wait_s`` for one (its own group rebuilt) before it ends with ``why``."""
        if running.parked_until is not None or self._resume_elsewhere(running, running.decode_rank.group_id):
            return
        running.lost = (running.decode_rank.group_id, running.incarnation)
        may_wait = (
            not running.abort_requested
            and not running.submitting
            and running.stream.migrations < self.max_migrations
            and self.migration_wait_s > 0
        )
        if not may_wait:
            running.stream.fail(why, running.decode_rank)
            return
        running.parked_until, running.parked_why = time.monotonic() + self.migration_wait_s, why
        self.router.finished(running.rank_request_id)  # no rank holds it while it waits

    def resume_parked(self, requests: list[Running]) -> None:
        """Requests waiting for a decode rank: resumed on one of the view's (a rebuilt group's
        too), or ended once they have waited ``migration_wait_s``."""
        now = time.monotonic()
        for running in requests:
            if running.parked_until is None or running.stream.finished:
                continue
            # on any rank but the failed incarnation's (the view may list it a while longer)
            if self._resume_elsewhere(running, *running.lost):
                running.parked_until = None
            elif now >= running.parked_until:
                running.parked_until = None
                running.stream.fail(running.parked_why, running.decode_rank)

    def _resume_elsewhere(self, running: Running, failed_group: str, incarnation: int | None = None) -> bool:
        """Move a request whose decode rank failed to a decode rank outside ``failed_group`` (at
        that incarnation, if given). False (nothing changed) when the request may not move
        again, was being aborted, or no other group takes work."""
        view, stream, members = self.membership.view, running.stream, self.membership
        if view is None or running.abort_requested or running.submitting:
            return False
        if stream.migrations >= self.max_migrations:
            return False

        def excluded(rank: RankId) -> bool:
            return rank.group_id == failed_group and incarnation in (None, members.incarnations.get(rank))

        left = [r for r in self.router.decode_ranks if not excluded(r)]
        tokens = tuple(stream.tokens)
        if not left or len(tokens) >= running.spec.sampling.max_tokens:
            return False
        # until the next view drops it (a colocated rank is a prefill rank too)
        self.router.set_ranks(left if view.colocated else self.router.prefill_ranks, left)
        old_id = running.rank_request_id
        try:
            _, submit = self.resend(running, tokens)
        except NoRankAvailable:
            return False
        self.router.finished(old_id)
        stream.migrated()
        if self.metrics is not None:
            self.metrics.migrations.inc()
        self._tasks.add(task := asyncio.ensure_future(self._resumed(submit, running, running.decode_rank)))
        task.add_done_callback(self._tasks.discard)
        log.warning(
            "request %s moved to decode rank %s after %d tokens",
            running.spec.request_id,
            running.decode_rank,
            len(tokens),
        )
        return True

    async def _resumed(self, submit: Any, running: Running, rank: RankId) -> None:
        """A resumed request the new decode rank refuses ends with its error."""
        try:
            await submit
        except SUBMIT_ERRORS as exc:
            if running.decode_rank == rank and not running.stream.finished:
                why = refusal(exc)[1]
                running.stream.fail(f"decode rank {rank} did not take the resumed request: {why}", rank)
