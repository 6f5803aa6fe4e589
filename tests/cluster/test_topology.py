from __future__ import annotations

from pathlib import Path

import pytest

from tandem.cluster.topology import Topology, TopologyError


@pytest.mark.parametrize(
    "name,prefill,decode",
    [
        ("local", (1, 2), (1, 2)),
        ("dep16-dep2", (1, 16), (1, 2)),
        ("dep16-dep8", (1, 16), (1, 8)),
        ("9xdep2-1xdep16", (9, 2), (1, 16)),
    ],
)
def test_presets(name: str, prefill: tuple[int, int], decode: tuple[int, int]) -> None:
    t = Topology.preset(name)
    assert t.name == name
    assert (t.prefill.groups, t.prefill.dep) == prefill and (t.decode.groups, t.decode.dep) == decode


def test_unknown_preset_lists_the_known_ones() -> None:
    with pytest.raises(TopologyError, match="local"):
        Topology.preset("nope")


def test_config_file_errors_name_the_field(tmp_path: Path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text("prefill:\n  groups: 0\n")
    with pytest.raises(TopologyError, match=r"prefill\.groups"):
        Topology.load(path)
    path.write_text("decode:\n  dpe: 2\n")
    with pytest.raises(TopologyError, match=r"decode\.dpe"):
        Topology.load(path)
    path.write_text("kv_transfer: sometimes\n")
    with pytest.raises(TopologyError, match="kv_transfer"):
        Topology.load(path)
    path.write_text("prefill: [\n")
    with pytest.raises(TopologyError, match="not valid YAML"):
        Topology.load(path)
    path.write_text("decode:\n  groups: 3\n  dep: 4\n")
    t = Topology.load(path)
    assert t.decode.ranks == 12 and t.prefill.dep == 2


@pytest.mark.parametrize(
    ("update", "field"),
    [
        ({"decode": {"host_cache_pages": 8}}, "decode.host_cache_pages"),
        ({"store": {"metadata": "http://127.0.0.1:8080/metadata"}}, "metadata"),
    ],
)
def test_kv_tiers_only_where_they_serve(update: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        Topology.model_validate(update)


def test_a_store_block_without_a_master_is_the_deployments_own() -> None:
    t = Topology.model_validate({"prefill": {"host_cache_pages": 64}, "store": {}})
    assert t.prefill.host_cache_pages == 64 and t.store is not None and t.store.master is None
    assert Topology.model_validate({"store": {"master": "10.0.0.5:50051"}}).store.master == "10.0.0.5:50051"


def test_a_master_beyond_loopback_is_the_operators_explicit_choice() -> None:
    with pytest.raises(ValueError, match=r"host: 10\.0\.0\.5 is reached from the network"):
        Topology.model_validate({"store": {"host": "10.0.0.5"}})
    t = Topology.model_validate({"store": {"host": "10.0.0.5", "trusted_network": True}})
    assert t.store is not None and t.store.trusted_network
    assert Topology.model_validate({"store": {}}).store.trusted_network is False  # type: ignore[union-attr]
