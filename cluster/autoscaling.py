"""The autoscaler at work in the controller. Every ``interval_s`` a tick reads the pools'
signals (Prometheus), takes the groups' states from the controller's own view (a scrape may lag
an action), lets the policy decide, logs and keeps each decision, and hands it to an action
thread. A tick never waits for an action: a drain waits for its group's requests, for minutes
maybe, and the other pool must still be decided on meanwhile::

    tick:    read -> decide -> record -> for each add/drain: pool busy? -> skip, logged
                                                             else       -> start its action
    action:  add: start desired - ready groups, one after another | drain: remove one group
             -> a failure is logged with its traceback and counted; a DrainTimeout (the drain
                was cancelled, the group serves again: the controller counts it) is logged

At most one action per pool is in flight (a controller restart may hand back more: the removals
it resumes). While a pool's actions run, its signals count the groups they have left as pending
(at least; the view's starting and draining groups already include the one under way), so the
policy holds "pending" for that pool.

Failures are never silent: a tick that raises is logged with its traceback and counted, and the
next tick tries again; a thread that dies (a ``BaseException``, or an error outside the tick) is
logged, and :meth:`ensure_running`, which the controller's watch calls, starts a new one and
counts it. With ``dry_run`` nothing is carried out."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from tandem.autoscaler.signals import MetricSource, PoolSignals
from tandem.metrics.controller import AutoscalerFigures
from tandem.wire.autoscaler_decision import Decision
from tandem.wire.messages import Role

log = logging.getLogger(__name__)

ACTIONS = ("add", "drain")
POOLS = (Role.PREFILL, Role.DECODE)


class DrainTimeout(TimeoutError):
    """A group still held requests when its drain's time was up: the drain was cancelled and the
    group takes work again. Raised by the controller's ``remove``."""

    def __init__(self, group_id: str, waited_s: float) -> None:
        super().__init__(
            f"{group_id} still held requests after {waited_s:.0f} s of draining: the drain was "
            "cancelled and the group takes work again"
        )
        self.group_id, self.waited_s = group_id, waited_s

    def __reduce__(self) -> tuple[type, tuple[str, float]]:  # crosses Ray calls intact
        return DrainTimeout, (self.group_id, self.waited_s)


class _Paced(Protocol):
    @property
    def interval_s(self) -> float: ...


class Policy(Protocol):
    """What the loop needs of a policy (``autoscaler/policy.py``'s ``Autoscaler``): one decision
    per pool each tick, and the time between ticks."""

    @property
    def config(self) -> _Paced: ...

    def decide(self, signals: dict[Role, PoolSignals]) -> list[Decision]: ...


@dataclass
class _Action:
    """One decision being carried out: ``left`` groups still to add or remove."""

    pool: Role
    kind: str  # "add" or "drain"
    left: int


class AutoscalerLoop:
    def __init__(
        self,
        policy: Policy,
        source: MetricSource,
        groups: Callable[[Role], tuple[int, int]],
        add: Callable[[Role], str],
        remove: Callable[[Role], str],
        dry_run: bool = False,
    ) -> None:
        """``groups(pool)`` is (ready, pending) from the controller's view; ``add(pool)`` starts a
        group and ``remove(pool)`` drains and stops one, each returning the group's id (both block
        until done; ``remove`` raises :class:`DrainTimeout` when it cancelled the drain, and
        counts that itself)."""
        self.policy, self.source = policy, source
        self._groups, self._add, self._remove = groups, add, remove
        self.dry_run = dry_run
        self.decisions: deque[tuple[float, Decision]] = deque(maxlen=64)  # (Unix time, decision)
        self.counts: dict[tuple[str, str, str], int] = {}  # (pool, action, rule) -> decisions
        self.desired: dict[str, int] = {}
        self.ticks = 0  # completed
        self.tick_errors = 0
        self.thread_restarts = 0
        self.action_failures = {(pool.value, kind): 0 for pool in POOLS for kind in ACTIONS}
        self.died_of: BaseException | None = None  # what ended the last thread
        self._ticking = threading.Lock()  # the policy decides one tick at a time
        self._lock = threading.Lock()  # the actions, the records and the counters
        self._actions: dict[Role, list[_Action]] = {pool: [] for pool in POOLS}
        self._idle = threading.Condition(self._lock)  # notified when an action ends
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """No tick after this; actions under way run to their end on their threads."""
        self._stop.set()

    def ensure_running(self) -> bool:
        """Start the loop's thread again if it died (logged and counted); whether it had."""
        thread = self._thread
        if self._stop.is_set() or thread is None or thread.is_alive():
            return False
        log.error("autoscaler: its thread had stopped (%r); starting it again", self.died_of)
        self.thread_restarts += 1
        self.start()
        return True

    def tick(self) -> list[Decision]:
        """Read, decide, record and hand each add or drain to its action thread; the decisions.
        Ticks run one at a time (the loop's and those the controller is asked for); one that
        raises is logged with its traceback and counted, and the error raised to the caller."""
        with self._ticking:
            try:
                return self._tick()
            except Exception:
                with self._lock:
                    self.tick_errors += 1
                    errors = self.tick_errors
                log.exception("autoscaler: the tick failed (%d so far)", errors)
                raise

    def _tick(self) -> list[Decision]:
        signals = self.source.read()
        for pool in signals:
            ready, pending = self._groups(pool)
            pending = max(pending, self.groups_left(pool))
            signals[pool] = replace(signals[pool], ready_groups=ready, pending_groups=pending)
        decisions = self.policy.decide(signals)
        for decision in decisions:
            self._record(decision)
        for decision in decisions:
            if decision.action != "hold" and not self.dry_run:
                self._act(decision)
        with self._lock:
            self.ticks += 1
        return decisions

    def recent_decisions(self, n: int) -> tuple[tuple[float, Decision], ...]:
        """The last ``n`` decisions with their Unix times, oldest first."""
        with self._lock:
            return tuple(self.decisions)[-n:]

    def groups_left(self, pool: Role) -> int:
        """Groups the pool's actions under way still have to add or remove."""
        with self._lock:
            return sum(a.left for a in self._actions[pool])

    def resume(self, pool: Role, kind: str, step: Callable[[], str]) -> None:
        """Carry on an action begun before the controller restarted (a removal) as this loop's:
        counted as pending and its failure counted. It runs even if the pool has one already."""
        action = _Action(pool, kind, 1)
        with self._lock:
            self._actions[pool].append(action)
        self._spawn(action, [step])

    def wait_actions(self, timeout_s: float) -> bool:
        """Wait until no action is under way; whether none is."""
        deadline = time.monotonic() + timeout_s
        with self._idle:
            while any(self._actions.values()):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._idle.wait(left)
        return True

    def figures(self) -> AutoscalerFigures:
        """The counters, for the controller's metrics (decisions counted by their rule's kind)."""
        by_reason: dict[tuple[str, str, str], int] = {}
        with self._lock:
            for (pool, action, rule), n in list(self.counts.items()):
                key = (pool, action, Decision(pool, action, rule, 0, 0).reason)
                by_reason[key] = by_reason.get(key, 0) + n
            return AutoscalerFigures(
                dict(self.desired),
                by_reason,
                ticks=self.ticks,
                tick_errors=self.tick_errors,
                thread_restarts=self.thread_restarts,
                action_failures=dict(self.action_failures),
            )

    def _act(self, decision: Decision) -> None:
        if decision.action not in ACTIONS:
            log.warning(
                "autoscaler: unknown action %r for %s: not carried out", decision.action, decision.pool
            )
            return
        pool = Role(decision.pool)
        n = decision.count
        action = _Action(pool, decision.action, n)
        with self._lock:  # adds may overlap (more groups for a load still growing); nothing else
            busy = any(a.kind != "add" or decision.action != "add" for a in self._actions[pool])
            if not busy:
                self._actions[pool].append(action)
        if busy:
            log.warning(
                "autoscaler: %s %s not carried out: the pool's last action is still under way",
                decision.action,
                decision.pool,
            )
            return
        step = self._add if decision.action == "add" else self._remove
        self._spawn(action, [lambda: step(pool)] * n)

    def _spawn(self, action: _Action, steps: list[Callable[[], str]]) -> None:
        name = f"autoscaler-{action.kind}-{action.pool.value}"
        threading.Thread(target=self._carry_out, args=(action, steps), name=name, daemon=True).start()

    def _carry_out(self, action: _Action, steps: list[Callable[[], str]]) -> None:
        """The groups of an add start side by side (one failing does not stop the others); a
        drain's go one after another, and the first that fails or times out ends it."""
        try:
            if action.kind == "add" and len(steps) > 1:
                threads = [
                    threading.Thread(target=self._step, args=(action, step), daemon=True) for step in steps
                ]
                for thread in threads:
                    thread.start()
                for thread in threads:
                    thread.join()
            else:
                for step in steps:
                    if not self._step(action, step):
                        break
        finally:
            with self._idle:
                self._actions[action.pool].remove(action)
                self._idle.notify_all()

    def _step(self, action: _Action, step: Callable[[], str]) -> bool:
        """One group added or removed; whether it was."""
        pool, kind = action.pool.value, action.kind
        try:
            group = step()
        except DrainTimeout as exc:  # not a failure: the controller counts the cancelled drain
            log.warning("autoscaler: drain of the %s pool cancelled: %s", pool, exc)
            return False
        except Exception:
            with self._lock:
                self.action_failures[(pool, kind)] = self.action_failures.get((pool, kind), 0) + 1
            log.exception("autoscaler: %s %s failed", kind, pool)
            return False
        with self._lock:
            action.left -= 1
        log.info("autoscaler: %s %s %s done", kind, pool, group)
        return True

    def _record(self, decision: Decision) -> None:
        with self._lock:
            self.decisions.append((time.time(), decision))
            key = (decision.pool, decision.action, decision.rule)
            self.counts[key] = self.counts.get(key, 0) + 1
            self.desired[decision.pool] = decision.desired_groups
        if decision.action != "hold":
            log.info(decision.to_json())

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.policy.config.interval_s):
                with contextlib.suppress(Exception):  # logged and counted: next tick again
                    self.tick()
        except BaseException as exc:  # the thread ends here; ensure_running starts a new one
            self.died_of = exc
            log.critical("autoscaler: its thread died", exc_info=True)
