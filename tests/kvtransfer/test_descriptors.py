from __future__ import annotations

import pytest

from tandem.kvtransfer.descriptors import PageRun, page_runs
from tandem.kvtransfer.regions import Region, TransferLayout
from tandem.kvtransfer.types import PoolLayout, decode_message, encode_message


def test_runs_coalesce_where_both_sides_are_contiguous() -> None:
    assert page_runs([7, 8, 9, 2, 3], [4, 5, 6, 10, 11]) == [PageRun(7, 4, 3), PageRun(2, 10, 2)]
    # ordered by destination; a break on either side starts a new run
    assert page_runs([1, 2, 3], [9, 5, 6]) == [PageRun(2, 5, 2), PageRun(1, 9, 1)]
    assert page_runs([1, 3], [5, 6]) == [PageRun(1, 5, 1), PageRun(3, 6, 1)]
    assert page_runs([5], [0]) == [PageRun(5, 0, 1)]
    with pytest.raises(ValueError, match="2 source pages but 1"):
        page_runs([1, 2], [3])


def test_prepared_indices_per_layer_and_side() -> None:
    runs = {"kv": [PageRun(7, 4, 2)]}
    src_layout = PoolLayout(0, 3, 10, 16, 40, "bfloat16", 10 * 1280, 1280, 1280).as_transfer()
    dst_layout = PoolLayout(0, 3, 6, 16, 40, "bfloat16", 6 * 1280, 1280, 1280).as_transfer()
    src, dst, nbytes = src_layout.indices(runs, [0, 2], dst_layout)
    assert src == [7, 8, 27, 28] and dst == [4, 5, 16, 17] and nbytes == 4 * 1280


def _v4_like(base: int, pages: int, slots: int) -> TransferLayout:
    """Two page kinds on some layers each, and a slot region whose layers differ in size."""
    compressed = Region("compressed.4", base, (0, 3), pages, 64, (0, pages * 64), (64, 64))
    keys = Region("indexer_keys", base + 10_000, (0, 3), pages, 32, (0, pages * 32), (32, 32))
    state = Region(
        "state", base + 20_000, (0, 1, 2, 3), slots, 1000, (0, 300, 800, 900), (300, 500, 100, 100), True
    )
    return TransferLayout((compressed, keys, state), 4, 16)


def test_regions_write_each_layers_pages_of_each_kind_and_its_slot() -> None:
    here, there = _v4_like(0, 5, 2), _v4_like(50_000, 8, 3)
    assert here.compatible_with(there) is None
    runs = {
        "compressed.4": [PageRun(1, 6, 2)],
        "indexer_keys": [PageRun(1, 6, 2)],
        "state": [PageRun(1, 2, 1)],
    }
    # layer 1: only the slot's span of it; layer 3: both kinds' pages and the slot
    assert here.indices(runs, [1], there) == ([20 + 1 * 2 + 1], [2 * 8 * 2 + 1 * 3 + 2], 500)
    src, dst, nbytes = here.indices(runs, [3], there)
    assert src == [5 + 1, 5 + 2, 10 + 5 + 1, 10 + 5 + 2, 20 + 3 * 2 + 1]
    assert dst == [8 + 6, 8 + 7, 16 + 8 + 6, 16 + 8 + 7, 32 + 3 * 3 + 2]
    assert nbytes == 2 * 64 + 2 * 32 + 100
    descs = here.descs()
    assert len(descs) == 2 * 5 + 2 * 5 + 4 * 2
    assert descs[20 + 1 * 2 + 1] == (20_000 + 300 + 1000, 500, 0)  # the slot's layer 1 of slot 1
    assert here.registrations()[2] == (20_000, 900 + 1000 + 100, 0, "")
    other = TransferLayout(here.regions[:2], 4, 16)
    assert "kinds differ" in (here.compatible_with(other) or "")
    assert "layers and page size differ" in (here.compatible_with(TransferLayout(here.regions, 4, 32)) or "")


def test_layout_addresses_and_compatibility() -> None:
    layout = PoolLayout(1000, 2, 4, 16, 40, "bfloat16", 4 * 1280, 1280, 1280)
    assert layout.page_address(1, 3) == 1000 + 5120 + 3840
    other = PoolLayout(9000, 2, 9, 16, 40, "bfloat16", 9 * 1280, 1280, 1280)
    assert layout.compatible_with(other) is None
    assert "page_size" in (layout.compatible_with(PoolLayout(0, 2, 4, 8, 40, "bfloat16", 0, 640, 640)) or "")


def test_messages_round_trip_and_garbage_is_rejected() -> None:
    msg = decode_message(encode_message("done", "r1", "prefill-0", first_token=5))
    assert msg == {"kind": "done", "request_id": "r1", "sender": "prefill-0", "first_token": 5}
    assert decode_message(b"\xff not json") is None
    assert decode_message(b'{"kind": "done"}') is None
