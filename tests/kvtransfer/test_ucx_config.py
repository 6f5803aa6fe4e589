"""The single-host transfer setting: what it adds, that the operator's values win, that a cluster
that may span nodes gets nothing forced, that Ray's workers receive it; and reading UCX's choice.
Without RDMA devices UCX's InfiniBand modules stay out, so a process holding a NIXL agent and a
Mooncake store client loads one copy of libnl (two crash the process at exit)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from tandem.kvtransfer.ucx_config import (
    NO_RDMA_MODULES,
    configure_ucx,
    has_rdma_devices,
    selected_transports,
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
    try:
        ray_bootstrap.init_ray(address)
    finally:
        ray_bootstrap.shutdown_ray()
    env = None if seen["runtime_env"] is None else seen["runtime_env"]["env_vars"]
    assert env == expected


def test_an_embedded_ray_takes_the_loopback_address_until_it_shuts_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ray resolves "127.0.0.1" to the host's outward address; an embedded Ray is told to keep
    the loopback one (its processes inherit the setting), and the process is as it was after."""
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
    ray_bootstrap.shutdown_ray()
    assert "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER" not in os.environ and ray_constants.ENABLE_RAY_CLUSTER

    ray_bootstrap.init_ray("10.0.0.1:6379")  # a cluster: its nodes' own addresses
    assert during["env"] is None


LOG = """\
[1.0] [vm:1:0]   +--------+-------------+-----------------------------------+
[1.0] [vm:1:0]   | send#1 self cfg#0                                        |
[1.0] [vm:1:0]   | remote memory write by ucp_put* from host memory to host |
[1.0] [vm:1:0]   +--------+-------------+-----------------------------------+
[1.0] [vm:1:0]   | Range  | Description |              Config               |
[1.0] [vm:1:0]   +--------+-------------+-----------------------------------+
[1.0] [vm:1:0]   | 0..inf | zero-copy   | self/memory                       |
[1.0] [vm:1:0]   +--------+-------------+-----------------------------------+
[2.0] [vm:1:0]     ucp_worker.c:1997 UCX  INFO    send#1 intra-node cfg#1 rma_am(tcp/lo) am(tcp/lo)
[2.0] [vm:1:0]   +--------+-------------+-----------------------------------+
[2.0] [vm:1:0]   | send#1 intra-node cfg#1                                  |
[2.0] [vm:1:0]   | remote memory write by ucp_put* from host memory to host |
[2.0] [vm:1:0]   +--------+-------------+-----------------------------------+
[2.0] [vm:1:0]   | Range  | Description |              Config               |
[2.0] [vm:1:0]   +--------+-------------+-----------------------------------+
[2.0] [vm:1:0]   | 0..inf | zero-copy   | cma/memory                        |
[2.0] [vm:1:0]   +--------+-------------+-----------------------------------+
[2.0] [vm:1:0]   +------------+--------------------+---------------+
[2.0] [vm:1:0]   | send#1 intra-node cfg#1                         |
[2.0] [vm:1:0]   | active message by ucp_am_send* from host memory |
[2.0] [vm:1:0]   +------------+--------------------+---------------+
[2.0] [vm:1:0]   |   Range    |    Description     |    Config     |
[2.0] [vm:1:0]   +------------+--------------------+---------------+
[2.0] [vm:1:0]   |          0 | short              | tcp/lo        |
[2.0] [vm:1:0]   | 16516..inf | multi-frag copy-in | tcp/lo        |
[2.0] [vm:1:0]   +------------+--------------------+---------------+
"""


def test_the_transports_ucx_selected_for_the_peer_not_for_itself() -> None:
    chosen = selected_transports(LOG)
    assert chosen.as_dict() == {
        "scope": "intra-node",
        "writes": ["0..inf zero-copy cma/memory"],
        "messages": ["0 short tcp/lo", "16516..inf multi-frag copy-in tcp/lo"],
    }


def test_no_tables_means_nothing_selected() -> None:
    assert selected_transports("UCX  INFO  Version 1.23.0\n").writes == ()


def test_without_rdma_devices_the_infiniband_modules_are_kept_out(tmp_path: Path) -> None:
    environ: dict[str, str] = {}
    assert configure_ucx(environ, tmp_path / "absent") == NO_RDMA_MODULES == environ["UCX_MODULES"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert configure_ucx({}, empty) == NO_RDMA_MODULES


def test_rdma_devices_or_the_operators_setting_leave_ucx_as_it_is(tmp_path: Path) -> None:
    devices = tmp_path / "infiniband"
    (devices / "mlx5_0").mkdir(parents=True)
    assert has_rdma_devices(devices)
    environ: dict[str, str] = {}
    assert configure_ucx(environ, devices) is None and environ == {}
    mine = {"UCX_MODULES": "^cuda"}
    assert configure_ucx(mine, tmp_path / "absent") == "^cuda" and mine == {"UCX_MODULES": "^cuda"}


@pytest.mark.skipif(has_rdma_devices(), reason="this machine has RDMA devices: UCX keeps its modules")
def test_a_process_with_a_nixl_agent_and_the_store_client_loads_one_libnl() -> None:
    script = textwrap.dedent(
        """
        import json, os
        from tandem.kvtransfer.nixl_transport import nixl_agent, nixl_agent_config
        agent = nixl_agent("libnl-check", nixl_agent_config(backends=["UCX"]))
        try:
            import mooncake.store  # links the system's libibverbs, and with it the system's libnl
        except ImportError:
            pass
        maps = open("/proc/self/maps").read().split()
        print(json.dumps(sorted({os.path.basename(p) for p in maps if "/libnl-3" in p})))
        os._exit(0)  # the copies' destructors are not what this checks
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "UCX_MODULES"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, env=env, check=True
    )
    copies = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(copies) <= 1, copies
