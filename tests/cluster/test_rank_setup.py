"""A DEP group's rendezvous: rank 0's store keeps its port bound from the moment it is chosen,
so nothing else on the node can take it before the group joins."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest
import torch.distributed as dist

from tandem.cluster.rank_setup import GroupRendezvous


def test_rank0_store_holds_its_port_and_serves_the_other_ranks() -> None:
    rendezvous = GroupRendezvous()
    master = rendezvous.open(timeout_s=10)
    host, _, port = master.rpartition(":")
    assert rendezvous.open(timeout_s=10) == master  # opening twice keeps the one store

    with socket.socket() as s, pytest.raises(OSError):
        s.bind((host, int(port)))

    client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=10))
    client.set("rank1", "ready")
    assert client.get("rank1") == b"ready"
