"""The single-host transfer setting: what it adds, that the operator's values win, that a cluster
that may span nodes gets nothing forced, that Ray's workers receive it; and reading UCX's choice."""

from __future__ import annotations

import os
from typing import Any

import pytest

from tandem.kvtransfer.ucx_config import selected_transports, single_host_transfer_env


def test_one_host_gets_huge_pages_and_leaves_the_transport_to_ucx() -> None:
    assert single_host_transfer_env({}, single_host=True) == {"THP_MEM_ALLOC_ENABLE": "1"}
    assert single_host_transfer_env({"UCX_TLS": "tcp,self"}, single_host=True) == {
        "THP_MEM_ALLOC_ENABLE": "1"
    }


def test_the_operators_value_wins() -> None:
    assert single_host_transfer_env({"THP_MEM_ALLOC_ENABLE": "0"}, single_host=True) == {}


def test_a_cluster_gets_nothing_forced() -> None:
    assert single_host_transfer_env({}, single_host=False) == {}


@pytest.mark.parametrize(
    ("address", "operator", "expected"),
    [
        (None, {}, {"THP_MEM_ALLOC_ENABLE": "1"}),
        (
            None,
            {"THP_MEM_ALLOC_ENABLE": "0", "UCX_TLS": "cma,tcp,self"},
            {"THP_MEM_ALLOC_ENABLE": "0", "UCX_TLS": "cma,tcp,self"},
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
