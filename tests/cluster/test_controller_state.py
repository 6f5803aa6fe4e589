"""The controller's record, what a restarted controller resumes: it round-trips through its
JSON form unchanged, an empty one stands for "nothing to resume", and a removal's deadline is
its start plus its timeout on the wall clock. (The GCS KV that keeps it is exercised in
tests/integration/test_autoscale.py, where the controller is killed and comes back.)"""

from __future__ import annotations

import json

from tandem.cluster.controller_state import AutoscalerSettings, ControllerRecord, Removal


def test_a_record_round_trips_through_json() -> None:
    record = ControllerRecord(
        autoscaler=AutoscalerSettings("http://127.0.0.1:9090", dry_run=True, drain_timeout_s=12.5),
        draining=("decode2", "prefill1"),
        removing=(Removal("decode2", 1_700_000_000.0, 12.5, by_autoscaler=True),),
    )
    text = record.to_json()
    assert ControllerRecord.from_json(text) == record
    assert json.loads(text)["removing"][0]["group_id"] == "decode2"
    assert record.removing[0].deadline_unix_s == 1_700_000_012.5


def test_an_empty_record_resumes_nothing() -> None:
    empty = ControllerRecord.from_json(ControllerRecord().to_json())
    assert empty == ControllerRecord() and empty.autoscaler is None
    assert ControllerRecord.from_json("{}") == ControllerRecord()
