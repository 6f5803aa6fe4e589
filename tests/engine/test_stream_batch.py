"""A push's tokens in columns: deltas of any length go in and come out as they were, through pickle."""

from __future__ import annotations

import pickle

import pytest

from tandem.wire.messages import RankId, StreamBatch, StreamColumns, TokenDelta

RANK = RankId("decode0", 0)


def test_deltas_of_any_length_round_trip_through_the_columns_and_pickle() -> None:
    deltas = (
        TokenDelta("a", 0, (5, 6, 7), (1.0, 1.1, 1.2), (9.0, 9.0, 9.0)),
        TokenDelta("b", 4, (8,), (2.0,), (9.5,)),
        TokenDelta("c", 2, (), (), ()),
        TokenDelta("a", 3, (1, 2), (1.3, 1.4), (9.6, 9.6)),
    )
    batch = pickle.loads(pickle.dumps(StreamBatch.of(RANK, deltas), protocol=pickle.HIGHEST_PROTOCOL))
    assert batch.deltas == deltas and batch.decode_rank == RANK and batch.finished == ()
    assert batch.ends == (3, 4, 4, 6) and batch.token_ids == (5, 6, 7, 8, 1, 2)


def test_a_delta_whose_times_do_not_match_its_tokens_is_refused() -> None:
    columns = StreamColumns()
    with pytest.raises(ValueError, match="request a: 2 tokens with 1 and 2 times"):
        columns.add("a", 0, (1, 2), (1.0,), (9.0, 9.0))
    assert columns.batch(RANK) == StreamBatch(RANK)  # nothing half-added
