"""The lockstep step loop of a prefill or decode rank of a DEP group.

Like the colocated rank loop (``engine/dep_rank.py``) every iteration ends in the one-integer
agreement and, if any rank has something to compute, a step (perhaps on an empty batch). Here the
work is a :class:`RoleWorker`; calls from other threads are queued as functions that the loop
thread runs at the top of an iteration, so only that thread touches the worker. ``tick`` (the
transport) runs every iteration, even when the group does not step. ``after_iteration`` runs on
the loop thread at the end of every iteration (and once more when the loop fails): the rank's
actor pushes token streams and KV events from there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from tandem.engine.dep import ExpertParallelDispatcher, any_rank_has_work

T = TypeVar("T")


class RoleWorker(Protocol):
    def tick(self) -> None: ...

    def has_work(self) -> bool:
        """Something to compute this step (not merely waiting on a transfer)."""
        ...

    def step(self) -> None: ...

    def take_results(self) -> list[Any]: ...

    def fail_all(self, reason: str) -> list[Any]:
        """End everything the worker holds with ``reason``; the results to report."""
        ...


class RoleRankLoop:
    def __init__(
        self,
        worker: RoleWorker,
        rank: int,
        dispatcher: ExpertParallelDispatcher,
        device: torch.device,
        idle_wait_s: float = 0.005,
        after_iteration: Callable[[], None] | None = None,
    ) -> None:
        self.worker = worker
        self.rank = rank
        self.dispatcher = dispatcher
        self.device = device
        self.idle_wait_s = idle_wait_s
        self.after_iteration = after_iteration
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._results_ready = threading.Condition(self._lock)
        self._calls: list[Callable[[Any], None]] = []
        self._results: list[Any] = []
        self.steps = 0
        self.failure: str | None = None

    def post(self, call: Callable[[Any], None]) -> None:
        """Run ``call(worker)`` on the loop thread (validate arguments before posting)."""
        with self._lock:
            if self.failure is not None:
                raise RuntimeError(f"rank {self.rank} has failed: {self.failure}")
            self._calls.append(call)
        self._ready.set()

    def call(self, function: Callable[[Any], T], timeout_s: float) -> T:
        """Run ``function(worker)`` on the loop thread and return its result (or raise its
        exception); ``TimeoutError`` when the loop does not get to it within ``timeout_s``."""
        done = threading.Event()
        outcome: list[Any] = []

        def run(worker: Any) -> None:
            try:
                outcome.append((True, function(worker)))
            except Exception as exc:  # handed to the caller, not the loop
                outcome.append((False, exc))
            done.set()

        self.post(run)
        if not done.wait(timeout_s):
            raise TimeoutError(f"rank {self.rank}: the step loop did not answer within {timeout_s} s")
        ok, value = outcome[0]
        if not ok:
            raise value
        return value

    def collect(self, timeout_s: float) -> list[Any]:
        with self._results_ready:
            if not self._results:
                self._results_ready.wait(timeout_s)
            out, self._results = self._results, []
            return out

    def run(self, stop: threading.Event) -> None:
        worker = self.worker
        try:
            while not stop.is_set():
                self._run_calls()
                worker.tick()
                has_work = worker.has_work()
                if not has_work and self._ready.wait(self.idle_wait_s):
                    self._run_calls()
                    has_work = worker.has_work()
                if any_rank_has_work(has_work, self.dispatcher.group, self.device):
                    worker.step()
                    self.steps += 1
                self._publish(worker.take_results())
                if self.after_iteration is not None:
                    self.after_iteration()
        except Exception as exc:
            reason = f"rank {self.rank} failed: {type(exc).__name__}: {exc}"
            with self._lock:
                self.failure = reason
            self._publish(worker.fail_all(reason))
            if self.after_iteration is not None:
                self.after_iteration()
            raise

    def _run_calls(self) -> None:
        with self._lock:
            calls, self._calls = self._calls, []
            self._ready.clear()
        for call in calls:
            call(self.worker)

    def _publish(self, results: list[Any]) -> None:
        if results:
            with self._results_ready:
                self._results.extend(results)
                self._results_ready.notify_all()
