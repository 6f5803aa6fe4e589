from __future__ import annotations

import pytest

from tandem.kvtransfer.descriptors import PageRun, page_runs, prepared_indices
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
    runs = [PageRun(7, 4, 2)]
    src, dst = prepared_indices(runs, [0, 2], src_num_pages=10, dst_num_pages=6)
    assert src == [7, 8, 27, 28] and dst == [4, 5, 16, 17]


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
