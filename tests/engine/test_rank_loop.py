"""The step loop's waits and the time it accounts for: with nothing to compute it waits for a call,
briefly while a KV transfer is in flight; with work it steps without waiting, and each piece of an
iteration is timed where it runs."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any

from tandem.engine.rank_loop import RankLoop, RankWorker
from tandem.wire.messages import LoopStats, RankId, RankStats, RequestResult, Role


class _Worker(RankWorker):
    """Scripted: ``plan`` holds one (has_work, transfers_in_flight) per iteration; stepping takes
    ``step_s`` and publishing ``publish_s``."""

    def __init__(self, plan: list[tuple[bool, bool]], stop: threading.Event) -> None:
        self.name = "w"
        self.plan, self.stop = plan, stop
        self.iteration = -1
        self.step_s = self.publish_s = 0.0

    def admit(self, items: list[Any]) -> Any:
        return items

    def submit(self, admitted: Any) -> None:
        pass

    def abort(self, request_id: str) -> None:
        pass

    def tick(self) -> None:
        self.iteration += 1
        if self.iteration >= len(self.plan) - 1:
            self.stop.set()

    def has_work(self) -> bool:
        return self.plan[self.iteration][0]

    def transfers_in_flight(self) -> bool:
        return self.plan[self.iteration][1]

    def step(self) -> None:
        time.sleep(self.step_s)

    def publish(self) -> None:
        time.sleep(self.publish_s)

    def take_results(self) -> list[RequestResult]:
        return []

    def fail_all(self, reason: str) -> list[RequestResult]:
        return []

    def stats(self, loop: LoopStats) -> RankStats:
        return RankStats(RankId("g", 0), Role.DECODE, 0, loop)

    def check_integrity(self) -> None:
        pass


class _RecordingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.timeouts: list[float | None] = []

    def wait(self, timeout: float | None = None) -> bool:
        self.timeouts.append(timeout)
        return super().wait(timeout)


def test_the_loop_waits_long_when_idle_briefly_during_a_transfer_and_not_with_work() -> None:
    stop = threading.Event()
    worker = _Worker([(False, False), (False, True), (True, True), (False, False)], stop)
    loop = RankLoop(worker, "w", agree=lambda has_work: has_work, idle_wait_s=0.02, transfer_poll_s=0.001)
    loop._ready = recorder = _RecordingEvent()
    loop.run(stop)
    assert recorder.timeouts == [0.02, 0.001, 0.02]  # the iteration with work did not wait
    stats = loop.stats().loop
    assert stats.steps == 1 and stats.idle_waits == 3
    assert stats.idle_s >= 0.02 + 0.001 + 0.02


def test_each_piece_of_an_iteration_is_timed_where_it_runs() -> None:
    """A known delay in ``step`` and in ``publish`` shows in their own figures only."""
    stop = threading.Event()
    worker = _Worker([(True, False)] * 3, stop)
    worker.step_s, worker.publish_s = 0.001, 0.05
    loop = RankLoop(worker, "w", agree=lambda has_work: has_work)
    loop.run(stop)
    stats = loop.stats().loop
    assert stats.steps == 3 and stats.idle_waits == 0 and stats.idle_s == 0
    assert stats.step_s >= 0.003 and stats.publish_s >= 0.15
    assert stats.step_s < 0.15  # the publishes' 150 ms are not in the steps'


class _Closing(_Worker):
    def __init__(self, plan: list[tuple[bool, bool]], stop: threading.Event, fail: bool = False) -> None:
        super().__init__(plan, stop)
        self.fail, self.closed = fail, 0

    def step(self) -> None:
        if self.fail:
            raise RuntimeError("a peer is gone")

    def close(self) -> None:
        self.closed += 1


def test_a_loop_that_stops_or_fails_closes_its_worker_and_each_role_closes_its_tiers() -> None:
    stop = threading.Event()
    worker = _Closing([(False, False)] * 2, stop)
    RankLoop(worker, "w", agree=lambda has_work: has_work).run(stop)
    assert worker.closed == 1
    failing = _Closing([(True, False)] * 2, threading.Event(), fail=True)
    with contextlib.suppress(RuntimeError):
        RankLoop(failing, "w", agree=lambda has_work: has_work).run(threading.Event())
    assert failing.closed == 1

    from types import SimpleNamespace

    from tandem.decode.worker import DecodeWorker
    from tandem.engine.colocated_worker import ColocatedWorker
    from tandem.prefill.worker import PrefillWorker

    closed: list[str] = []

    def tiers(name: str) -> SimpleNamespace:
        return SimpleNamespace(tiers=SimpleNamespace(close=lambda: closed.append(name)))

    PrefillWorker.close(SimpleNamespace(copier=tiers("prefill")))  # type: ignore[arg-type]
    DecodeWorker.close(SimpleNamespace(writeback=tiers("decode")))  # type: ignore[arg-type]
    ColocatedWorker.close(SimpleNamespace(engine=SimpleNamespace(copier=tiers("colocated"))))  # type: ignore[arg-type]
    assert closed == ["prefill", "decode", "colocated"]
