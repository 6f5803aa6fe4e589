"""A rank's one inbox: every message a rank receives is a ``wire/rank_inbox.py`` dataclass, taken
in the order it came at the top of a loop iteration and dispatched to its worker on the loop's
thread; questions are answered to the thread that asked; a failed loop takes no message."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from tandem.engine.rank_loop import RankFailed, RankLoop, RankWorker
from tandem.wire.messages import LoopStats, RankId, RankStats, RequestResult, Role
from tandem.wire.prefill_job import PrefillJobAnswer
from tandem.wire.rank_inbox import (
    Abort,
    CheckIntegrity,
    ConnectPeers,
    JobAnswers,
    PeersLost,
    Reply,
    SetPeers,
    Submit,
    Subscribe,
)


class _Recorder(RankWorker):
    """Records each call with the thread it ran on; stops the loop once ``until`` calls came."""

    def __init__(self, stop: threading.Event, until: int) -> None:
        self.name, self.stop, self.until = "w", stop, until
        self.calls: list[tuple[str, Any]] = []
        self.threads: set[int] = set()
        self.broken = False

    def _record(self, call: str, value: Any) -> None:
        self.calls.append((call, value))
        self.threads.add(threading.get_ident())
        if len(self.calls) >= self.until:
            self.stop.set()

    def admit(self, items: list[Any]) -> Any:
        return tuple(items)

    def submit(self, admitted: Any) -> list[Any] | None:
        self._record("submit", admitted)
        return [PrefillJobAnswer(item, "w") for item in admitted]

    def abort(self, request_id: str) -> None:
        self._record("abort", request_id)

    def prefill_answered(self, answer: PrefillJobAnswer) -> None:
        self._record("answered", answer.request_id)

    def set_peers(self, peers: dict[Any, Any]) -> None:
        self._record("set_peers", dict(peers))

    def connect_peers(self, ranks: list[str]) -> None:
        self._record("connect_peers", ranks)

    def peers_lost(self, ranks: list[str]) -> None:
        self._record("peers_lost", ranks)

    def subscribe(self, subscriber: str) -> Any:
        self._record("subscribe", subscriber)
        return f"snapshot for {subscriber}"

    def check_integrity(self) -> None:
        self._record("check_integrity", None)
        if self.broken:
            raise ValueError("page 3: refcount 2 but 1 owning requests")

    def tick(self) -> None:
        pass

    def has_work(self) -> bool:
        return False

    def step(self) -> None:
        pass

    def take_results(self) -> list[RequestResult]:
        return []

    def fail_all(self, reason: str) -> list[RequestResult]:
        return []

    def stats(self, loop: LoopStats) -> RankStats:
        return RankStats(RankId("g", 0), Role.DECODE, 0, loop)


def test_each_message_reaches_its_worker_call_in_order_on_the_loop_thread() -> None:
    stop = threading.Event()
    worker = _Recorder(stop, until=9)
    loop = RankLoop(worker, "w", agree=lambda has_work: has_work, idle_wait_s=0.01)
    answered: list[list[PrefillJobAnswer]] = []
    # posted before the loop runs: none is taken until an iteration begins
    loop.post(Submit(worker.admit(["a#0", "b#0"]), answered.append))
    loop.post(Abort(("a#0",)))
    loop.post(JobAnswers((PrefillJobAnswer("c#1", "p0", "full"),)))
    loop.post(SetPeers({"p0": "handle"}))
    loop.post(ConnectPeers(("p0", "p1")))
    loop.post(PeersLost(("p1",)))
    loop.post(Submit(worker.admit(["d#0"])))  # no one to answer: its answers are dropped
    assert worker.calls == []
    runner = threading.Thread(target=loop.run, args=(stop,))
    runner.start()
    assert loop.ask(Subscribe("frontend-0", Reply()), timeout_s=10) == "snapshot for frontend-0"
    loop.ask(CheckIntegrity(Reply()), timeout_s=10)
    runner.join(10)
    assert worker.calls == [
        ("submit", ("a#0", "b#0")),
        ("abort", "a#0"),
        ("answered", "c#1"),
        ("set_peers", {"p0": "handle"}),
        ("connect_peers", ["p0", "p1"]),
        ("peers_lost", ["p1"]),
        ("submit", ("d#0",)),
        ("subscribe", "frontend-0"),
        ("check_integrity", None),
    ]
    assert worker.threads == {runner.ident}  # every call on the loop's thread, none on ours
    assert answered == [[PrefillJobAnswer("a#0", "w"), PrefillJobAnswer("b#0", "w")]]


def test_a_question_gets_its_answers_exception_and_a_silent_loop_a_timeout() -> None:
    stop = threading.Event()
    worker = _Recorder(stop, until=2)
    worker.broken = True
    loop = RankLoop(worker, "w", agree=lambda has_work: has_work, idle_wait_s=0.01)
    with pytest.raises(TimeoutError, match=r"rank w: the step loop did not answer within 0\.05 s"):
        loop.ask(CheckIntegrity(Reply()), timeout_s=0.05)  # no loop runs yet
    runner = threading.Thread(target=loop.run, args=(stop,))
    runner.start()
    with pytest.raises(ValueError, match="page 3: refcount 2"):  # the worker's, raised here
        loop.ask(CheckIntegrity(Reply()), timeout_s=10)
    runner.join(10)
    assert not runner.is_alive()  # the loop itself went on: it stopped when told


def test_a_failed_loop_takes_no_message() -> None:
    class _Failing(_Recorder):
        def tick(self) -> None:
            raise RuntimeError("a peer is gone mid-collective")

    loop = RankLoop(_Failing(threading.Event(), until=99), "w", agree=lambda has_work: has_work)
    with pytest.raises(RuntimeError, match="a peer is gone"):
        loop.run(threading.Event())
    with pytest.raises(RankFailed, match="rank w has failed: rank w failed: RuntimeError"):
        loop.post(Abort(("a#0",)))
