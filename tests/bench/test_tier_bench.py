"""``tandem bench tiers``' configurations: the same device capacity, the lower tiers added one by
one (the served runs themselves are the bench command's, not a test's)."""

from __future__ import annotations

import pytest

from tandem.bench.serve_bench import Plan
from tandem.bench.tier_bench import CONFIGS, configure, run_tiers
from tandem.cluster.topology import Topology
from tandem.wire.request_params import InvalidRequestError


def test_each_configuration_keeps_the_device_capacity_and_adds_its_tiers() -> None:
    local = Topology.preset("local")
    shapes = {c: configure(local, c, device_pages=24, host_pages=256) for c in CONFIGS}
    assert {c: t.prefill.num_pages for c, t in shapes.items()} == dict.fromkeys(CONFIGS, 24)
    assert [shapes[c].prefill.host_cache_pages for c in CONFIGS] == [0, 256, 256]
    assert [shapes[c].store is not None for c in CONFIGS] == [False, False, True]
    assert shapes["host+store"].store.master is None  # the deployment runs its own master
    assert all(t.decode == local.decode for t in shapes.values())


@pytest.mark.parametrize(
    ("device", "host", "field"), [(0, 8, "--device-cache-pages"), (8, 0, "--host-cache-pages")]
)
def test_sizes_are_checked_before_anything_starts(device: int, host: int, field: str) -> None:
    with pytest.raises(InvalidRequestError) as error:
        run_tiers(Topology.preset("local"), Plan.__new__(Plan), device, host, None, "float32", 0)
    assert error.value.field == field
