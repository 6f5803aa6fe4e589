"""The autoscaler at work in the controller: every ``interval_s`` it reads the pools' signals
(Prometheus), takes the groups' states from the controller's own view (a scrape may lag an
action), lets the policy decide, logs and keeps each decision, and carries it out: an add starts
a group, a drain removes the pool's newest group. Actions run one at a time on this thread, so a
tick never overlaps one; with ``dry_run`` nothing is carried out."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import replace

from tandem.autoscaler.policy import Autoscaler
from tandem.autoscaler.signals import MetricSource
from tandem.wire.autoscaler_decision import Decision
from tandem.wire.messages import Role

log = logging.getLogger(__name__)


class AutoscalerLoop:
    def __init__(
        self,
        policy: Autoscaler,
        source: MetricSource,
        groups: Callable[[Role], tuple[int, int]],
        add: Callable[[Role], str],
        remove: Callable[[Role], str],
        dry_run: bool = False,
    ) -> None:
        """``groups(pool)`` is (ready, pending) from the controller's view; ``add(pool)`` starts a
        group and ``remove(pool)`` drains and stops one, each returning the group's id."""
        self.policy, self.source = policy, source
        self._groups, self._add, self._remove = groups, add, remove
        self.dry_run = dry_run
        self.decisions: deque[tuple[float, Decision]] = deque(maxlen=64)  # (Unix time, decision)
        self.counts: dict[tuple[str, str, str], int] = {}  # (pool, action, rule) -> decisions
        self.desired: dict[str, int] = {}
        self.errors = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="autoscaler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def tick(self) -> list[Decision]:
        """Read, decide, record and act once; the decisions."""
        signals = self.source.read()
        for pool in signals:
            ready, pending = self._groups(pool)
            signals[pool] = replace(signals[pool], ready_groups=ready, pending_groups=pending)
        decisions = self.policy.decide(signals)
        for decision in decisions:
            self._record(decision)
        for decision in decisions:
            if decision.action != "hold" and not self.dry_run:
                pool = Role(decision.pool)
                group = self._add(pool) if decision.action == "add" else self._remove(pool)
                log.info("autoscaler: %s %s %s (%s)", decision.action, decision.pool, group, decision.rule)
        return decisions

    def _record(self, decision: Decision) -> None:
        self.decisions.append((time.time(), decision))
        key = (decision.pool, decision.action, decision.rule)
        self.counts[key] = self.counts.get(key, 0) + 1
        self.desired[decision.pool] = decision.desired_groups
        if decision.action != "hold":
            log.info(decision.to_json())

    def _run(self) -> None:
        interval = self.policy.config.interval_s
        while not self._stop.wait(interval):
            try:
                self.tick()
            except Exception:  # an unreachable Prometheus or a failed start: next tick again
                self.errors += 1
                log.exception("autoscaler: the tick failed")
