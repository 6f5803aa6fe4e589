"""Embedded Ray start-up: a raylet that misses Ray's registration deadline is killed and started again."""

from __future__ import annotations

from typing import Any

import pytest
import ray
from ray._private.node import Node

from tandem.cluster import ray_bootstrap


class _HalfStartedNode(Node):
    """A node object as ``ray.init`` holds it when its constructor raises: only its processes matter."""

    def __init__(self) -> None:  # nothing is started
        self.killed: list[dict[str, bool]] = []

    def kill_all_processes(self, check_alive: bool = True, allow_graceful: bool = False, wait: bool = False):
        self.killed.append({"check_alive": check_alive, "wait": wait})


def _raise_from_node(node: Node, message: str) -> None:
    self = node  # the frame local the recovery looks for, as in Node.__init__
    assert self is node
    raise Exception(message)


@pytest.fixture
def fake_init(monkeypatch: pytest.MonkeyPatch):
    calls: list[dict[str, Any]] = []
    failures: list[tuple[Node, str]] = []

    def init(**kwargs: Any) -> None:
        calls.append(kwargs)
        if failures:
            node, message = failures.pop(0)
            _raise_from_node(node, message)

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    return calls, failures


def test_a_start_past_the_deadline_is_killed_and_tried_again(fake_init) -> None:
    calls, failures = fake_init
    node = _HalfStartedNode()
    failures.append((node, "The current node timed out during startup. This could happen ..."))
    ray_bootstrap.init_ray(num_cpus=2)
    assert len(calls) == 2 and calls[1]["num_cpus"] == 2
    assert node.killed == [{"check_alive": False, "wait": True}]


def test_a_second_timeout_and_other_errors_are_raised(fake_init) -> None:
    calls, failures = fake_init
    first, second = _HalfStartedNode(), _HalfStartedNode()
    failures += [(first, "timed out during startup"), (second, "timed out during startup")]
    with pytest.raises(Exception, match="timed out during startup"):
        ray_bootstrap.init_ray(num_cpus=1)
    assert len(calls) == 2 and len(first.killed) == 1 and not second.killed

    calls.clear()
    other = _HalfStartedNode()
    failures.append((other, "address already in use"))
    with pytest.raises(Exception, match="already in use"):
        ray_bootstrap.init_ray(num_cpus=1)
    assert len(calls) == 1 and not other.killed
