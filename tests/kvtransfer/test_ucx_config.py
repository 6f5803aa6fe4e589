"""The single-host transfer setting: what it adds, that the operator's values win, that a cluster
that may span nodes gets nothing forced, that Ray's workers receive it; and reading UCX's choice.
Without RDMA devices UCX's InfiniBand modules stay out, so a process holding a NIXL agent and a
Mooncake store client loads one copy of libnl (two crash the process at exit)."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tandem.kvtransfer.ucx_config import (
    single_host_transfer_env,
)


def test_one_host_gets_huge_pages_and_loopback_and_leaves_the_transport_to_ucx() -> None:
    one_host = {"THP_MEM_ALLOC_ENABLE": "1", "UCX_NET_DEVICES": "lo"}
    assert single_host_transfer_env({}, single_host=True) == one_host
    assert single_host_transfer_env({"UCX_TLS": "tcp,self"}, single_host=True) == one_host


def test_the_operators_value_wins() -> None:
    operator = {"THP_MEM_ALLOC_ENABLE": "0", "UCX_NET_DEVICES": "eth0"}
    assert single_host_transfer_env(operator, single_host=True) == {}


def test_a_cluster_gets_nothing_forced() -> None:
    assert single_host_transfer_env({}, single_host=False) == {}


@pytest.mark.parametrize(
    ("address", "operator", "expected"),
    [
        (None, {}, {"THP_MEM_ALLOC_ENABLE": "1", "UCX_NET_DEVICES": "lo"}),
        (
            None,
            {"THP_MEM_ALLOC_ENABLE": "0", "UCX_TLS": "cma,tcp,self"},
            {"THP_MEM_ALLOC_ENABLE": "0", "UCX_TLS": "cma,tcp,self", "UCX_NET_DEVICES": "lo"},
        ),
        ("10.0.0.1:6379", {}, None),
        ("auto", {"UCX_TLS": "rc,tcp"}, {"UCX_TLS": "rc,tcp"}),
    ],
)
def test_ray_workers_receive_it(
    monkeypatch: pytest.MonkeyPatch,
    address: str | None,
    operator: dict[str, str],
    expected: dict[str, str] | None,
) -> None:
    import ray

    from tandem.cluster import ray_bootstrap

    for key in [k for k in os.environ if k.startswith(("TANDEM_", "TRITON_", "UCX_", "THP_"))]:
        monkeypatch.delenv(key)
    for key, value in operator.items():
        monkeypatch.setenv(key, value)
    seen: dict[str, Any] = {}
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", lambda **kwargs: seen.update(kwargs))
    ray_bootstrap.init_ray(address)
    env = None if seen["runtime_env"] is None else seen["runtime_env"]["env_vars"]
    assert env == expected


def test_an_embedded_ray_starts_on_the_loopback_address(monkeypatch: pytest.MonkeyPatch) -> None:
    """Ray resolves "127.0.0.1" to the host's outward address; an embedded Ray is told to keep
    the loopback one while it starts (the processes it starts inherit the setting), and this
    process is as it was once it has (a cluster started later is not affected)."""
    import ray
    from ray._private import ray_constants, services

    from tandem.cluster import ray_bootstrap

    monkeypatch.delenv("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", raising=False)
    during: dict[str, Any] = {}

    def init(**kwargs: Any) -> None:
        during["env"] = os.environ.get("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER")
        during["address"] = services.get_node_ip_address()

    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    ray_bootstrap.init_ray(None)
    assert during == {"env": "0", "address": "127.0.0.1"}
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ and ray_constants.ENABLE_RAY_CLUSTER

    ray_bootstrap.init_ray("10.0.0.1:6379")  # a cluster: its nodes' own addresses
    assert during["env"] is None
