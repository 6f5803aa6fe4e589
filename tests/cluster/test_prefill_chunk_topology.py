"""``--prefill-chunk-tokens`` reaches the pool that prefills: the prefill pool of a
disaggregated topology (its ranks' schedulers), the colocated pool otherwise."""

from __future__ import annotations

import argparse

from tandem.cli.serving import with_prefill_chunk
from tandem.cluster.pool_roles import pool_roles
from tandem.cluster.topology import Topology
from tandem.engine.colocated_role import ColocatedRole
from tandem.prefill.role import PrefillRole


def test_the_flag_sets_the_prefilling_pool_and_its_role() -> None:
    args = argparse.Namespace(prefill_chunk_tokens=32)
    disaggregated = with_prefill_chunk(args, Topology.preset("local"))
    assert (
        disaggregated.prefill.prefill_chunk_tokens == 32 and disaggregated.decode.prefill_chunk_tokens is None
    )
    role = pool_roles(disaggregated, None, b"s" * 32)[0][2]
    assert isinstance(role, PrefillRole) and role.prefill_chunk_tokens == 32
    colocated = with_prefill_chunk(args, Topology.preset("colocated"))
    assert colocated.colocated is not None and colocated.colocated.prefill_chunk_tokens == 32
    role = pool_roles(colocated, None, b"s" * 32)[0][2]
    assert isinstance(role, ColocatedRole) and role.engine.prefill_chunk_tokens == 32
    unset = argparse.Namespace(prefill_chunk_tokens=None)
    assert with_prefill_chunk(unset, Topology.preset("local")) == Topology.preset("local")
