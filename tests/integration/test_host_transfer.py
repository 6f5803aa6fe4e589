"""A real NIXL transfer between two processes on loopback with the single-host default: byte for
byte, over the transport UCX reports it chose, with the figures ``tandem bench host`` reads."""

from __future__ import annotations

import os

import pytest

from tandem.bench.kvtransfer_bench import measure_transfer


def test_single_host_transfer_is_byte_exact_and_reports_its_transports() -> None:
    result = measure_transfer(size_mib=4, repeats=1)
    assert result["bytes_match"] is True
    expected_thp = os.environ.get("THP_MEM_ALLOC_ENABLE", "1")  # the operator's value wins
    assert result["ucx_env"]["THP_MEM_ALLOC_ENABLE"] == expected_thp
    transports = result["ucx_transports"]
    assert transports["scope"] == "intra-node"
    if "UCX_TLS" not in os.environ:  # UCX's own choice on one host: cross-memory attach
        assert any("cma" in row for row in transports["writes"]), transports
    for name in ("nixl_gbps", "memcpy_gbps", "layerwise_nixl_gbps"):
        assert result[name] > 0
    assert result["nixl_over_memcpy"] == pytest.approx(
        result["nixl_gbps"] / result["memcpy_gbps"], rel=2e-2, abs=2e-3
    )
    assert result["layerwise_nixl_over_memcpy"] == pytest.approx(
        result["layerwise_nixl_gbps"] / result["memcpy_gbps"], rel=2e-2, abs=2e-3
    )


def test_bad_sizes_are_refused_with_the_field_named() -> None:
    with pytest.raises(ValueError, match="size_mib"):
        measure_transfer(size_mib=0)
    with pytest.raises(ValueError, match="repeats"):
        measure_transfer(size_mib=1, repeats=0)
