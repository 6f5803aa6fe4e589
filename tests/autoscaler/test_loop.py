"""The autoscaler's loop in the controller, with a scripted policy and fake actions: it takes
group states from the controller (not the scrape), records every decision, hands adds and drains
to action threads (a tick never waits for one; the pool counts it as pending meanwhile), counts
a cancelled drain and a failed action apart, and never stops silently: a tick that raises is
logged and counted, a thread that dies is started again."""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pytest
from prometheus_client import generate_latest

from tandem.autoscaler.signals import MetricSource, PoolSignals
from tandem.cluster.autoscaling import AutoscalerLoop, DrainTimeout
from tandem.metrics.controller import ControllerMetrics
from tandem.metrics.labels import ControllerLabels
from tandem.wire.autoscaler_decision import Decision
from tandem.wire.messages import Role

SCRAPED = {  # the scrape's group counts lag: the loop must use the controller's
    Role.PREFILL: PoolSignals(ready_groups=9, latency_p90_s=5.0),
    Role.DECODE: PoolSignals(ready_groups=9, latency_p90_s=0.01),
}


class _Scraped(MetricSource):
    def __init__(self, fail_first: int = 0) -> None:
        self.fail_left = fail_first

    def read(self) -> dict[Role, PoolSignals]:
        if self.fail_left:
            self.fail_left -= 1
            raise ConnectionError("Prometheus is unreachable")
        return dict(SCRAPED)


@dataclass(frozen=True)
class _Config:
    interval_s: float = 3600.0


@dataclass
class _Policy:
    """Decides what it is told, once, per pool (then holds); keeps the signals of every tick."""

    config: _Config = field(default_factory=_Config)
    wants: dict[Role, tuple[str, int]] = field(default_factory=dict)  # pool -> (action, step)
    seen: list[dict[Role, PoolSignals]] = field(default_factory=list)
    raise_once: BaseException | None = None
    respects_pending: bool = True

    def decide(self, signals: dict[Role, PoolSignals]) -> list[Decision]:
        self.seen.append(dict(signals))
        if self.raise_once is not None:
            exc, self.raise_once = self.raise_once, None
            raise exc
        out = []
        for pool in (Role.PREFILL, Role.DECODE):
            s = signals[pool]
            action, step = self.wants.pop(pool, ("hold", 0))
            rule = "pending" if s.pending_groups else ("slo" if action == "add" else "calm")
            if s.pending_groups and self.respects_pending:
                action, step = "hold", 0
            out.append(Decision(pool.value, action, rule, s.ready_groups, s.ready_groups + step))
        return out


@dataclass
class _Pools:
    """The controller's side: groups per pool, and adds and removes that may be held back."""

    ready: dict[Role, int] = field(default_factory=lambda: {Role.PREFILL: 1, Role.DECODE: 2})
    actions: list[str] = field(default_factory=list)
    gate: threading.Event = field(default_factory=threading.Event)  # a held action waits on it
    hold: bool = False
    fail: BaseException | None = None

    def __post_init__(self) -> None:
        self.gate.set()

    def groups(self, pool: Role) -> tuple[int, int]:
        return self.ready[pool], 0

    def act(self, verb: str) -> Callable[[Role], str]:
        def do(pool: Role) -> str:
            self.actions.append(f"{verb} {pool.value}")
            if self.hold:
                assert self.gate.wait(10), "the test never let the action finish"
            if self.fail is not None:
                raise self.fail
            self.ready[pool] += 1 if verb == "add" else -1
            return f"{pool.value}{self.ready[pool]}"

        return do


def _loop(
    policy: _Policy, pools: _Pools, dry_run: bool = False, source: MetricSource | None = None
) -> AutoscalerLoop:
    return AutoscalerLoop(
        policy, source or _Scraped(), pools.groups, pools.act("add"), pools.act("drain"), dry_run
    )


def test_the_policy_sees_the_controllers_group_counts_and_each_decision_is_kept() -> None:
    policy, pools = _Policy(wants={Role.PREFILL: ("add", 1)}), _Pools()
    loop = _loop(policy, pools)
    decisions = loop.tick()
    assert [s.ready_groups for s in policy.seen[0].values()] == [1, 2]  # not the scrape's 9
    assert [d.action for d in decisions] == ["add", "hold"]
    assert loop.wait_actions(10) and pools.actions == ["add prefill"]
    assert loop.desired == {"prefill": 2, "decode": 2}
    assert loop.counts[("prefill", "add", "slo")] == 1 and len(loop.decisions) == 2
    assert loop.ticks == 1


def test_a_dry_run_decides_and_records_but_does_not_act() -> None:
    pools = _Pools()
    loop = _loop(_Policy(wants={Role.PREFILL: ("add", 1)}), pools, dry_run=True)
    assert loop.tick()[0].action == "add"
    assert loop.wait_actions(10) and pools.actions == []
    assert loop.counts[("prefill", "add", "slo")] == 1


def test_a_tick_returns_while_a_drain_waits_and_the_pool_counts_it_as_pending() -> None:
    policy, pools = _Policy(wants={Role.DECODE: ("drain", -1)}), _Pools(hold=True)
    pools.gate.clear()  # the drain waits for its group's requests until the test lets it end
    loop = _loop(policy, pools)
    started = time.monotonic()
    assert loop.tick()[1].action == "drain"
    assert time.monotonic() - started < 1.0, "the tick waited for the drain"
    deadline = time.monotonic() + 10
    while pools.actions != ["drain decode"]:
        assert time.monotonic() < deadline, "the drain never started"
        time.sleep(0.01)

    # the drain is still waiting: ticks go on, are recorded, and see it pending
    second = loop.tick()
    assert policy.seen[1][Role.DECODE].pending_groups == 1
    assert policy.seen[1][Role.PREFILL].pending_groups == 0  # the other pool is decided freely
    assert (second[1].action, second[1].rule) == ("hold", "pending")
    assert len(loop.decisions) == 4 and loop.ticks == 2
    assert not loop.wait_actions(0.05)

    # a policy that drains again while the drain still runs: not carried out, one at a time
    policy.respects_pending, policy.wants[Role.DECODE] = False, ("drain", -1)
    assert loop.tick()[1].action == "drain"
    assert pools.actions == ["drain decode"]

    pools.gate.set()
    assert loop.wait_actions(10)
    assert loop.groups_left(Role.DECODE) == 0 and pools.ready[Role.DECODE] == 1


def test_an_add_for_several_groups_starts_them_side_by_side_and_counts_those_left_as_pending() -> None:
    """All three starts are under way while none has finished (one after another, the second
    would wait for the first); the pool counts them as pending until each ends."""
    policy, pools = _Policy(wants={Role.PREFILL: ("add", 3)}), _Pools(hold=True)
    pools.gate.clear()
    loop = _loop(policy, pools)
    loop.tick()
    deadline = time.monotonic() + 10
    while len(pools.actions) < 3:
        assert time.monotonic() < deadline, f"only {pools.actions} under way at once"
        time.sleep(0.01)
    assert loop.groups_left(Role.PREFILL) == 3
    loop.tick()
    assert policy.seen[1][Role.PREFILL].pending_groups == 3
    pools.gate.set()
    assert loop.wait_actions(10)
    assert pools.actions == ["add prefill"] * 3 and pools.ready[Role.PREFILL] == 4
    assert loop.groups_left(Role.PREFILL) == 0


def test_a_drain_of_several_groups_removes_them_one_after_another() -> None:
    policy, pools = _Policy(wants={Role.DECODE: ("drain", -2)}), _Pools(hold=True)
    pools.ready[Role.DECODE] = 3
    pools.gate.clear()
    loop = _loop(policy, pools)
    assert loop.tick()[1].count == 2
    deadline = time.monotonic() + 10
    while not pools.actions:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    time.sleep(0.2)
    assert pools.actions == ["drain decode"]  # the second waits for the first
    pools.gate.set()
    assert loop.wait_actions(10)
    assert pools.actions == ["drain decode"] * 2 and pools.ready[Role.DECODE] == 1


def test_a_cancelled_drain_is_logged_not_failed_and_a_failed_add_is_logged_and_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "tandem.cluster.autoscaling")
    pools = _Pools(fail=DrainTimeout("decode1", 300.0))
    loop = _loop(_Policy(wants={Role.DECODE: ("drain", -1)}), pools)
    loop.tick()
    assert loop.wait_actions(10)
    assert sum(loop.action_failures.values()) == 0  # the controller counts a cancelled drain
    cancelled = [r for r in caplog.records if "decode1 still held requests" in r.getMessage()]
    assert [r.levelno for r in cancelled] == [logging.WARNING]

    pools.fail = RuntimeError("no room for the group's placement")
    loop.policy = _Policy(wants={Role.PREFILL: ("add", 1)})
    loop.tick()
    assert loop.wait_actions(10)
    assert loop.action_failures[("prefill", "add")] == 1
    failed = [r for r in caplog.records if r.getMessage() == "autoscaler: add prefill failed"]
    assert failed and failed[0].exc_info is not None  # with its traceback


def test_a_failing_tick_is_logged_with_its_traceback_counted_and_the_loop_goes_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    policy = _Policy(config=_Config(interval_s=0.01))
    loop = _loop(policy, _Pools(), source=_Scraped(fail_first=2))
    loop.start()
    try:
        deadline = time.monotonic() + 10
        while loop.ticks < 2:
            assert time.monotonic() < deadline, "the loop stopped ticking after a failed tick"
            time.sleep(0.01)
    finally:
        loop.stop()
    assert loop.tick_errors == 2
    failed = [r for r in caplog.records if "the tick failed" in r.getMessage()]
    assert len(failed) == 2 and all(r.exc_info is not None for r in failed)
    assert "Prometheus is unreachable" in caplog.text


class _Fatal(BaseException):
    """What a tick's ``except Exception`` does not catch."""


def test_a_thread_that_died_is_reported_and_started_again(caplog: pytest.LogCaptureFixture) -> None:
    policy = _Policy(config=_Config(interval_s=0.01), raise_once=_Fatal("the policy blew up"))
    loop = _loop(policy, _Pools())
    assert not loop.ensure_running()  # never started: nothing to restart
    loop.start()
    try:
        deadline = time.monotonic() + 10
        while loop.died_of is None or (loop._thread is not None and loop._thread.is_alive()):
            assert time.monotonic() < deadline, "the thread did not die"
            time.sleep(0.01)
        assert isinstance(loop.died_of, _Fatal) and loop.ticks == 0
        assert any(r.levelno == logging.CRITICAL and r.exc_info for r in caplog.records)
        assert loop.ensure_running() and loop.thread_restarts == 1
        while loop.ticks < 1:
            assert time.monotonic() < deadline, "the restarted thread did not tick"
            time.sleep(0.01)
        assert not loop.ensure_running()  # alive: left alone
    finally:
        loop.stop()
    assert any("starting it again" in r.getMessage() for r in caplog.records if r.levelno == logging.ERROR)


def test_the_failure_counters_are_exported() -> None:
    pools = _Pools(fail=RuntimeError("no room for the group's placement"))
    policy = _Policy(config=_Config(interval_s=0.01), wants={Role.PREFILL: ("add", 1)})
    loop = _loop(policy, pools, source=_Scraped(fail_first=1))
    loop.start()
    try:
        deadline = time.monotonic() + 10
        while loop.ticks < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert loop.wait_actions(10)
    finally:
        loop.stop()
    cancelled = {"prefill": 0, "decode": 1}  # the controller's count, added to the loop's figures
    metrics = ControllerMetrics(
        ControllerLabels("m"), lambda: [], lambda: replace(loop.figures(), drain_timeouts=cancelled)
    )
    text = generate_latest(metrics.registry).decode()
    assert 'tandem_autoscaler_tick_errors_total{model="m"} 1.0' in text
    assert re.search(r'tandem_autoscaler_ticks_total\{model="m"\} [1-9]', text)
    assert 'tandem_autoscaler_action_failures_total{action="add",model="m",pool="prefill"} 1.0' in text
    assert 'tandem_autoscaler_action_failures_total{action="drain",model="m",pool="decode"} 0.0' in text
    assert 'tandem_autoscaler_drain_timeouts_total{model="m",pool="decode"} 1.0' in text
    assert 'tandem_autoscaler_thread_restarts_total{model="m"} 0.0' in text


def test_an_add_while_adds_start_is_carried_out_but_a_drain_waits_for_them() -> None:
    """A load that outgrows the groups still starting gets more at once; a drain while groups
    start is not carried out (nor an add while a drain runs: see above)."""
    policy, pools = _Policy(wants={Role.PREFILL: ("add", 1)}, respects_pending=False), _Pools(hold=True)
    pools.gate.clear()
    loop = _loop(policy, pools)
    loop.tick()
    policy.wants[Role.PREFILL] = ("add", 2)
    decided = loop.tick()[0]
    assert decided.action == "add" and decided.count == 2
    deadline = time.monotonic() + 10
    while loop.groups_left(Role.PREFILL) != 3:
        assert time.monotonic() < deadline, "the second add was not carried out"
        time.sleep(0.01)
    policy.wants[Role.PREFILL] = ("drain", -1)
    assert loop.tick()[0].action == "drain"
    assert loop.groups_left(Role.PREFILL) == 3  # the drain was not started
    pools.gate.set()
    assert loop.wait_actions(10)
    assert pools.actions.count("add prefill") == 3 and "drain prefill" not in pools.actions
    assert pools.ready[Role.PREFILL] == 4
