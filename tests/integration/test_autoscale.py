"""``tandem serve --autoscale`` on this machine: a real Prometheus (started by the server)
scrapes the deployment and the controller's autoscaler acts on what it reads. The test drives
the ticks itself (the topology's interval is an hour) so that each decision meets a known load:
a burst of long prompts adds a prefill group, many concurrent long generations add a decode
group, and idle, both pools drain back to one group. Every request ends with the reference
tokens; afterwards every page is free. (On 2 cores a new group adds no capacity: what is checked
is the decisions and the mechanics.)

Then its faults: a drain that cannot finish is cancelled at its timeout (the group serves again),
and a controller killed mid-run comes back with the autoscaler running and its drains restored."""

from __future__ import annotations

import asyncio
import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import cast

import pytest
import ray
import torch

from tandem.client.grpc_client import ClientOptions, status
from tandem.cluster.autoscaling import DrainTimeout
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import AutoscalingSpec, PoolBounds, PoolSpec, Topology
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.frontend.running import GenerateSpec
from tandem.wire.autoscaler_decision import Decision
from tandem.wire.request_params import SamplingParams
from tandem.wire.routing_view import RoutingView
from tandem.wire.stream_summary import StreamSummary
from tests.integration.prometheus_server import Prometheus

PAGE = 16
MAX_ROUNDS = 8  # rounds of decode load at most before the decode group must have been added


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[Server]:
    prefill = PoolSpec(dep=2, page_size=PAGE, num_pages=128)
    # 1536 tokens a rank: a round of long generations ends at three quarters of it (past the KV
    # target for most of the round, so two ticks in a row see it however fast the host is), a
    # held request fills most of it
    decode = PoolSpec(dep=2, page_size=PAGE, num_pages=96)
    autoscaling = AutoscalingSpec(
        prefill=PoolBounds(min_groups=1, max_groups=2),
        decode=PoolBounds(min_groups=1, max_groups=2),
        rank_budget=8,
        ttft_slo_s=0.05,
        itl_slo_s=10.0,  # decode scales on its KV usage here
        prefill_queue_target_s=100.0,
        decode_queue_target_s=100.0,
        kv_usage_target=0.3,
        interval_s=3600.0,  # the test ticks
        window="15s",
        upscale_ticks=2,
        downscale_ticks=2,
        settle_ticks=0,
    )
    topology = Topology.preset("local").model_copy(
        update={"prefill": prefill, "decode": decode, "autoscaling": autoscaling}
    )
    options = ServeOptions(
        topology, tiny_dir, port=0, dtype="float64", metrics_port=0, autoscale=True, scrape_interval_s=0.5
    )
    served = Server(options)
    try:
        served.start()
        yield served
    finally:
        served.stop()
        ray.shutdown()


def _tick(server: Server) -> dict[str, Decision]:
    """One tick, then its actions carried out (a tick itself does not wait for them)."""
    time.sleep(1.5)  # a scrape or two since the last tick
    decisions = ray.get(server.controller.autoscaler_tick.remote(), timeout=300)
    assert ray.get(server.controller.wait_autoscaler.remote(300), timeout=330)
    return {d.pool: d for d in decisions}


def _groups(server: Server, role: str) -> list[str]:
    view = ray.get(server.controller.routing_view.remote())
    return sorted(g.group_id for g in view.groups if g.role.value == role and g.state == "ready")


def _run(
    server: Server, prompts: list[list[int]], sampling: SamplingParams, out: list[StreamSummary]
) -> None:
    out.extend(server.generate(prompts, [sampling] * len(prompts), timeout_s=600))


def _reference(tiny: Path, prompts: list[list[int]], sampling: SamplingParams) -> list[list[int]]:
    engine = ColocatedEngine.from_model_dir(tiny, torch.float64, EngineConfig(page_size=PAGE, num_pages=1024))
    return [o.token_ids for o in engine.generate(prompts, [sampling] * len(prompts))]


def test_load_adds_groups_and_idle_drains_them(server: Server, tiny_dir: Path) -> None:
    rng = random.Random(5)
    assert _groups(server, "prefill") == ["prefill0"] and _groups(server, "decode") == ["decode0"]

    # a burst of long prompts: time to first token breaks its SLO, the decode pool stays calm
    burst = [[rng.randrange(256) for _ in range(500)] for _ in range(12)]
    one = SamplingParams(max_tokens=1, ignore_eos=True)
    done: list[StreamSummary] = []
    _run(server, burst, one, done)
    # the planner, once it has measured the pool, sizes it ("plan"); before, the SLO rule does
    first = _tick(server)
    assert first["prefill"].action == "hold" and first["prefill"].rule in ("slo 1/2", "plan 1/2"), first
    second = _tick(server)
    assert second["prefill"].action == "add" and second["prefill"].rule in ("slo", "plan"), second
    if second["prefill"].rule == "plan":
        assert second["prefill"].inputs["plan"]["groups"] >= 2, second
    assert second["decode"].action == "hold"
    assert _groups(server, "prefill") == ["prefill0", "prefill1"]

    # many concurrent long generations: the decode ranks' KV fills, a decode group is added.
    # The load is kept up, round after round, until the decision comes (or MAX_ROUNDS): how
    # long one round lasts depends on the machine, and the rule wants two ticks in a row
    long = SamplingParams(max_tokens=120, ignore_eos=True)
    generations = [[rng.randrange(256) for _ in range(20)] for _ in range(16)]
    generated: list[StreamSummary] = []
    enough = threading.Event()

    def keep_loading() -> None:
        for _ in range(MAX_ROUNDS):
            _run(server, generations, long, generated)
            if enough.is_set():
                return

    worker = threading.Thread(target=keep_loading)
    worker.start()
    decisions = []
    while not any(d["decode"].action == "add" for d in decisions) and worker.is_alive():
        decisions.append(_tick(server))
    enough.set()
    worker.join(timeout=600)
    added = [d["decode"] for d in decisions if d["decode"].action == "add"]
    assert added and added[0].rule in ("kv", "plan"), [d["decode"].rule for d in decisions]
    assert _groups(server, "decode") == ["decode0", "decode1"]
    assert all(d["prefill"].action != "add" for d in decisions)  # prefill is at its max_groups

    # every request ended with the reference tokens
    assert [s.error for s in done + generated] == [None] * (len(burst) + len(generated))
    assert [s.token_ids for s in done] == _reference(tiny_dir, burst, one)
    rounds, left = divmod(len(generated), len(generations))
    assert rounds >= 1 and left == 0
    assert [s.token_ids for s in generated] == _reference(tiny_dir, generations, long) * rounds

    # idle: once the window holds no traffic, both pools drain back to their minimum
    deadline = time.monotonic() + 240
    while _groups(server, "prefill") != ["prefill0"] or _groups(server, "decode") != ["decode0"]:
        assert time.monotonic() < deadline, _tick(server)
        ticked = _tick(server)
        assert all(d.action != "add" for d in ticked.values()), ticked
    ray.get(server.controller.check_integrity.remote())
    stats = ray.get(server.controller.stats.remote())
    assert all(s.free_pages == s.total_pages for s in stats), stats
    # the decisions are kept for ClusterStatus and counted in the controller's metrics
    reply = asyncio.run(status(ClientOptions(f"127.0.0.1:{server.port}")))
    kept = list(reply.autoscaler_decisions)
    assert kept and "drain" in {d.action for d in kept}
    assert all(json.loads(d.inputs_json)["ready_groups"] == d.ready_groups for d in kept)
    assert server.prometheus is not None
    metrics = Prometheus(server.prometheus.url)
    metrics.wait_for('sum(tandem_autoscaler_decisions_total{action="add"})', 2)
    metrics.wait_for('sum(tandem_autoscaler_decisions_total{action="drain"})', 2)
    metrics.wait_for("sum(tandem_autoscaler_desired_groups)", 2)


# -- faults ------------------------------------------------------------------------------------
DRAIN_TIMEOUT_S = 8.0
HELD = SamplingParams(max_tokens=1400, ignore_eos=True)  # 88 of a decode rank's 96 pages
SHORT = SamplingParams(max_tokens=4, ignore_eos=True)


def _view(server: Server) -> RoutingView:
    return cast(RoutingView, ray.get(server.controller.routing_view.remote(), timeout=60))


def _state(server: Server, group_id: str) -> str | None:
    states = {g.group_id: g.state.value for g in _view(server).groups}
    return states.get(group_id)


def _send(
    server: Server, tag: str, prompts: list[list[int]], sampling: SamplingParams
) -> list[StreamSummary]:
    """Concurrent requests under ids of their own (each call to ``Server.generate`` reuses its)."""
    specs = [GenerateSpec(f"{tag}-{i}", p, sampling) for i, p in enumerate(prompts)]
    return list(ray.get(server.frontend.generate.remote(specs), timeout=600))


def _hold(server: Server, tag: str, ranks: int) -> tuple[threading.Thread, list[StreamSummary]]:
    """One long request per decode rank (the router sends each to the rank with the fewest),
    running on a thread until they end."""
    rng = random.Random(len(tag))
    prompts = [[rng.randrange(256) for _ in range(8)] for _ in range(ranks)]
    out: list[StreamSummary] = []
    thread = threading.Thread(target=lambda: out.extend(_send(server, tag, prompts, HELD)))
    thread.start()
    return thread, out


def _holds_requests(server: Server, group_id: str) -> bool:
    stats = ray.get(server.controller.stats.remote(), timeout=60)
    return any(s.running + s.queued for s in stats if s.rank.group_id == group_id)


def _wait(what: str, done: Callable[[], bool], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not done():
        assert time.monotonic() < deadline, f"{what} within {timeout_s:.0f} s"
        time.sleep(0.2)


def _added(server: Server, role: str) -> str:
    added = str(ray.get(server.controller.add_group.remote(role), timeout=300))
    assert _state(server, added) == "ready"
    time.sleep(1.0)  # the frontend reads the view every 0.2 s
    return added


def test_a_drain_that_cannot_finish_is_cancelled_at_its_timeout(server: Server) -> None:
    """A decode group is removed while it holds long requests. While the drain waits, the group
    is draining and gets no new request (they all go to decode0); at the drain's timeout, with
    the requests still running, the drain is cancelled: the group is ready again in the view,
    nothing of it was stopped (same incarnation, same ranks), the cancel is counted, and new
    requests are routed to it again. The held requests end untouched."""
    extra = _added(server, "decode")
    before = next(g for g in _view(server).groups if g.group_id == extra)
    held, held_out = _hold(server, "held-cancel", ranks=4)
    _wait(f"{extra} holds a request", lambda: _holds_requests(server, extra), 60)

    started = time.monotonic()
    removal = server.controller.remove_group.remote(extra, timeout_s=DRAIN_TIMEOUT_S)
    _wait(f"{extra} draining", lambda: _state(server, extra) == "draining", 5)
    assert not any(r.group_id == extra for r in _view(server).decode)
    time.sleep(1.0)  # the frontend has the view without it
    during = _send(server, "during-drain", [[3, 1, 4, 1, 5]] * 6, SHORT)
    assert [s.error for s in during] == [None] * 6
    assert {s.decode_rank.group_id for s in during if s.decode_rank is not None} == {"decode0"}
    assert time.monotonic() - started < DRAIN_TIMEOUT_S and _state(server, extra) == "draining"

    with pytest.raises(ray.exceptions.RayTaskError, match="the drain was cancelled") as raised:
        ray.get(removal, timeout=DRAIN_TIMEOUT_S + 120)
    assert isinstance(raised.value.cause, DrainTimeout)
    assert time.monotonic() - started >= DRAIN_TIMEOUT_S  # not before its time
    assert held.is_alive(), "the held requests ended before the drain's timeout: make them longer"
    after = next(g for g in _view(server).groups if g.group_id == extra)
    assert after.state.value == "ready" and (after.incarnation, after.ranks) == (
        before.incarnation,
        before.ranks,
    )
    assert {r.group_id for r in _view(server).decode} == {"decode0", extra}
    figures = ray.get(server.controller.autoscaler_figures.remote())
    assert figures is not None and figures.drain_timeouts == {"prefill": 0, "decode": 1}

    time.sleep(1.0)
    again = _send(server, "after-cancel", [[2, 7, 1, 8]] * 8, SHORT)
    assert [s.error for s in again] == [None] * 8
    assert extra in {s.decode_rank.group_id for s in again if s.decode_rank is not None}
    held.join(timeout=600)
    assert [(s.error, len(s.token_ids)) for s in held_out] == [(None, HELD.max_tokens)] * 4


def test_a_restarted_controller_resumes_the_autoscaler_and_its_drains(server: Server) -> None:
    """The controller is killed while a decode group's removal waits for its requests and a
    prefill group is drained. Ray restarts it: the autoscaler runs again with the settings it
    had (it ticks, and sees the drained prefill group as pending), both groups are still
    draining (the draining set was restored), and the removal is resumed: once the requests end,
    the decode group is stopped. The held requests end untouched."""
    extras = [
        g.group_id for g in _view(server).groups if g.role.value == "decode" and g.group_id != "decode0"
    ]
    decode_extra = extras[0] if extras else _added(server, "decode")
    prefill_extra = _added(server, "prefill")
    ray.get(server.controller.drain.remote(prefill_extra), timeout=60)
    settings = ray.get(server.controller.autoscaler_settings.remote())
    assert server.prometheus is not None and settings is not None
    assert (settings.prometheus_url, settings.dry_run) == (server.prometheus.url, False)

    held, held_out = _hold(server, "held-restart", ranks=4)
    _wait(f"{decode_extra} holds a request", lambda: _holds_requests(server, decode_extra), 60)
    removal = server.controller.remove_group.remote(decode_extra, timeout_s=600)
    _wait(f"{decode_extra} draining", lambda: _state(server, decode_extra) == "draining", 5)
    assert held.is_alive()
    killed = _view(server).controller
    assert killed is not None
    ray.kill(server.controller, no_restart=False)

    deadline = time.monotonic() + 120
    view = None
    while view is None:  # answered by the restarted process (a call just after the kill may not be)
        assert time.monotonic() < deadline, "the controller did not come back"
        try:
            answer = ray.get(server.controller.routing_view.remote(), timeout=10)
        except ray.exceptions.RayError:
            answer = None
        if answer is not None and answer.controller is not None and answer.controller.pid != killed.pid:
            view = answer
        else:
            time.sleep(0.5)
    with pytest.raises(ray.exceptions.RayError):
        ray.get(removal, timeout=60)  # its caller's call died with the controller; the removal did not
    states = {g.group_id: g.state.value for g in view.groups}
    assert states[prefill_extra] == "draining"
    assert states.get(decode_extra) in ("draining", None)  # None: its requests ended meanwhile
    assert ray.get(server.controller.autoscaler_settings.remote()) == settings
    decisions = {d.pool: d for d in ray.get(server.controller.autoscaler_tick.remote(), timeout=300)}
    assert (decisions["prefill"].action, decisions["prefill"].rule) == ("hold", "pending")
    if states.get(decode_extra) == "draining":
        assert decisions["decode"].rule == "pending", decisions["decode"]
    figures = ray.get(server.controller.autoscaler_figures.remote())
    assert figures is not None and figures.ticks == 1 and figures.tick_errors == 0

    held.join(timeout=600)
    assert [(s.error, len(s.token_ids)) for s in held_out] == [(None, HELD.max_tokens)] * 4
    _wait(f"{decode_extra} removed", lambda: _state(server, decode_extra) is None, 120)
    assert _state(server, prefill_extra) == "draining"  # a drain without removal stays one
    ray.get(server.controller.remove_group.remote(prefill_extra), timeout=300)
    assert ray.get(server.frontend.wait_ready.remote(120))
    assert {g.group_id for g in _view(server).groups} == {"prefill0", "decode0"}
    ray.get(server.controller.check_integrity.remote())
