"""The decode scheduler with drafts: pages for every draft's position, taken only from free
pages (drafts never preempt), freed as soon as the verify step rejects them; a step's tokens are
appended in order and a stop condition cuts them; the outputs are those of plain decoding.
The fake model of ``test_scheduler.py`` checks that every position reads back its context."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler_output import SchedulerOutput, StaleSchedulerOutputError
from tandem.engine.speculation import accept
from tests.decode.test_scheduler import PAGE, Cluster, expected_outputs, make_request, token_for

# drafts for a request at output index o: right for the first ``good`` tokens, then wrong
Drafts = Callable[[Request], tuple[int, ...]]


def right_then_wrong(k: int, good: int) -> Drafts:
    def drafts(request: Request) -> tuple[int, ...]:
        o = len(request.output_token_ids)
        right = [token_for(request.request_id, o + j) for j in range(k)]
        return tuple(t if j < good else t + 1 for j, t in enumerate(right))

    return drafts


class SpecCluster(Cluster):
    def spec_step(self, drafts: Drafts, k: int) -> SchedulerOutput:
        s = self.scheduler
        planned = s.schedule({r.request_id: k for r in s.running_requests()})
        self.check()
        proposed = {c.request_id: drafts(s.get(c.request_id))[: c.draft_room] for c in planned.chunks}  # type: ignore[arg-type]
        output = s.with_drafts(planned, proposed)
        self.check()
        self.preempted.extend(output.preempted_request_ids)
        sampled: dict[str, tuple[int, ...]] = {}
        for chunk in output.chunks:
            rid = chunk.request_id
            request = s.get(rid)
            assert request is not None and request.status is RequestStatus.RUNNING
            assert chunk.token_ids == (request.output_token_ids[-1], *chunk.draft_token_ids)
            assert chunk.draft_token_ids == proposed[rid] and len(chunk.draft_token_ids) <= chunk.draft_room
            known = self.page_tables[rid]
            assert list(chunk.page_ids[: len(known)]) == known, "a running request's pages moved"
            self._blank(chunk.page_ids[len(known) :])
            self.page_tables[rid] = list(chunk.page_ids)
            start = chunk.start_position
            for j, token in enumerate(chunk.token_ids):  # a verify step writes every position
                position = start + j
                self.kv[chunk.page_ids[position // PAGE], position % PAGE] = token
                context = [self.kv[chunk.page_ids[p // PAGE], p % PAGE] for p in range(position + 1)]
                assert context == request.all_token_ids + list(chunk.draft_token_ids[:j])
            target = [token_for(rid, chunk.output_index + j) for j in range(len(chunk.draft_token_ids) + 1)]
            sampled[rid] = accept(chunk.draft_token_ids, target)
        for record in s.update(output, sampled):
            self._record(record)
        for chunk in output.chunks:  # a live request keeps no page past its next token's
            request = s.get(chunk.request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                assert len(request.page_ids) <= -(-request.num_tokens // PAGE)
                self.page_tables[chunk.request_id] = list(request.page_ids)
        self.check()
        return output

    def spec_drain(self, drafts: Drafts, k: int, max_iterations: int = 10_000) -> int:
        for steps in range(max_iterations):
            if not self.scheduler.has_unfinished_requests():
                return steps
            self.reserve()
            for rid in list(self.transfers):
                self.deliver(rid)
            self.spec_step(drafts, k)
        raise AssertionError("requests did not finish")


@pytest.mark.parametrize(("k", "good"), [(1, 1), (3, 0), (3, 2), (5, 5)])
def test_drafts_give_the_outputs_of_plain_decoding_in_fewer_steps(k: int, good: int) -> None:
    cluster = SpecCluster()
    requests = [make_request(f"r{i}", 5 + i, max_tokens=13) for i in range(3)]
    cluster.add(*requests)
    steps = cluster.spec_drain(right_then_wrong(k, good), k)
    for r in requests:
        assert cluster.finished[r.request_id].request.output_token_ids == expected_outputs(r.request_id, 13)
    # each step gives every request good + 1 tokens (fewer at the end): 12 decoded outputs
    assert steps == -(-12 // (min(good, k) + 1))
    cluster.assert_all_free()


def test_a_stop_token_among_a_steps_tokens_cuts_them_there() -> None:
    rid = "s"
    stop = token_for(rid, 3)
    cluster = SpecCluster()
    cluster.add(Request(rid, [1, 2, 3], make_request(rid, 3, max_tokens=20, stop=(stop,)).sampling))
    cluster.spec_drain(right_then_wrong(5, 5), 5)
    record = cluster.finished[rid]
    assert record.request.output_token_ids == expected_outputs(rid, 20, stop=(stop,))
    assert record.request.output_token_ids[-1] == stop and record.finish_reason == "stop"
    cluster.assert_all_free()


@pytest.mark.parametrize("max_tokens", [1, 2, 3])
def test_max_tokens_below_k_still_works_and_never_overshoots(max_tokens: int) -> None:
    cluster = SpecCluster()
    cluster.add(make_request("m", 4, max_tokens=max_tokens))
    cluster.reserve()
    cluster.deliver("m")
    if max_tokens > 1:
        request = cluster.scheduler.get("m")
        assert request is not None and cluster.scheduler.draft_limit(request, 5) == max_tokens - 2
    cluster.spec_drain(right_then_wrong(5, 5), 5)
    assert cluster.finished["m"].request.output_token_ids == expected_outputs("m", max_tokens)
    cluster.assert_all_free()


def test_draft_pages_come_only_from_free_pages_and_are_freed_when_rejected() -> None:
    # two requests of 6 prompt tokens (7 with the first output) fill 4 of 5 pages; 5 drafts
    # need one more page each: the one free page holds a's, and b drafts only into the slot
    # left in its own last page
    cluster = SpecCluster(num_pages=5)
    cluster.add(make_request("a", 6, max_tokens=8), make_request("b", 6, max_tokens=8))
    cluster.reserve()
    cluster.deliver("a")
    cluster.deliver("b")
    assert cluster.scheduler.num_free_pages == 1
    output = cluster.spec_step(right_then_wrong(5, 0), 5)
    a, b = output.chunks
    assert not output.preempted_request_ids  # drafts never preempt
    assert len(a.draft_token_ids) == 5 and len(b.draft_token_ids) == 1  # a took the free page first
    assert cluster.scheduler.num_free_pages == 1  # every draft was wrong: its page is back
    cluster.spec_drain(right_then_wrong(5, 0), 5)
    assert cluster.preempted == [] or all(cluster.finished[r] for r in cluster.preempted)
    for rid in ("a", "b"):
        assert cluster.finished[rid].request.output_token_ids == expected_outputs(rid, 8)
    cluster.assert_all_free()


def test_an_update_with_more_tokens_than_drafts_is_refused() -> None:
    cluster = SpecCluster()
    cluster.add(make_request("x", 4))
    cluster.reserve()
    cluster.deliver("x")
    output = cluster.scheduler.with_drafts(cluster.scheduler.schedule({"x": 3}), {"x": (5,)})
    with pytest.raises(StaleSchedulerOutputError, match="3 tokens for x"):
        cluster.scheduler.update(output, {"x": (1, 2, 3)})


@pytest.mark.parametrize("seed", range(6))
def test_random_scenario_with_drafts(seed: int) -> None:
    """Random arrivals, draft quality, K and a small pool (preemption): every output is plain
    decoding's, and every page is accounted for after every call."""
    rng = random.Random(seed)
    cluster = SpecCluster(num_pages=rng.randrange(10, 20), max_num_seqs=rng.randrange(2, 5))
    pending = [
        make_request(f"q{i}", rng.randrange(1, 12), max_tokens=rng.randrange(1, 14)) for i in range(10)
    ]
    expected = {r.request_id: expected_outputs(r.request_id, r.sampling.max_tokens) for r in pending}
    for _ in range(2000):
        if pending and rng.random() < 0.3:
            cluster.add(pending.pop())
        if not pending and not cluster.scheduler.has_unfinished_requests():
            break
        cluster.reserve()
        for rid in list(cluster.transfers):
            if rng.random() < 0.7:
                cluster.deliver(rid)
        k = rng.randrange(0, 6)
        cluster.spec_step(right_then_wrong(k, rng.randrange(0, k + 1)), k)
    assert {rid: r.request.output_token_ids for rid, r in cluster.finished.items()} == expected
    cluster.assert_all_free()
