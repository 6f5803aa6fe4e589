from __future__ import annotations

import multiprocessing
import os
import threading
from pathlib import Path

import pytest
import ray

from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import Topology, TopologyError
from tandem.engine.cpu_affinity import check_cores, node_cores, pin_process


def test_a_core_the_node_lacks_is_refused_by_name() -> None:
    total = node_cores()
    assert check_cores([total - 1, 0, 0], "frontend_cores") == tuple(sorted({0, total - 1}))
    with pytest.raises(ValueError, match=rf"frontend_cores: core {total} is not a core of this node"):
        check_cores([0, total], "frontend_cores")


@pytest.mark.parametrize(
    "text,why",
    [("[-1]", "a core is a number from 0"), ("[0, 0]", "each core once"), ("[]", "at least 1 item")],
)
def test_frontend_cores_are_checked_in_the_topology(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(f"frontend_cores: {text}\n")
    with pytest.raises(TopologyError, match=rf"t.yaml: frontend_cores: .*{why}"):
        Topology.load(path)


def test_serve_refuses_a_missing_frontend_core_before_starting_anything(tmp_path: Path) -> None:
    topology = Topology(name="t", frontend_cores=[0, node_cores() + 3])
    server = Server(ServeOptions(topology, tmp_path, port=0))
    with pytest.raises(TopologyError, match=rf"t: frontend_cores: core {node_cores() + 3} is not a core"):
        server.start()
    assert not ray.is_initialized()


def _pinned_threads(conn: multiprocessing.connection.Connection) -> None:
    started, release = threading.Event(), threading.Event()

    def before() -> None:  # a thread that exists before the pin
        started.set()
        release.wait()

    thread = threading.Thread(target=before)
    thread.start()
    started.wait()
    pin_process([0])
    later: list[set[int]] = []
    after = threading.Thread(target=lambda: later.append(os.sched_getaffinity(0)))  # one started after
    after.start()
    after.join()
    tasks = {int(t): os.sched_getaffinity(int(t)) for t in os.listdir("/proc/self/task")}
    release.set()
    thread.join()
    conn.send((tasks, later[0], thread.native_id))


def test_pin_process_pins_every_thread_and_the_threads_they_start() -> None:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    process = ctx.Process(target=_pinned_threads, args=(child,))
    process.start()
    tasks, later, earlier_id = parent.recv()
    process.join(30)
    assert process.exitcode == 0
    assert earlier_id in tasks and len(tasks) >= 2
    assert all(cores == {0} for cores in tasks.values()), tasks
    assert later == {0}
