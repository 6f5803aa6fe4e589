"""The committed gRPC stubs are what ``python -m protos.generate`` writes from the proto."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tandem.protos.generate import ROOT, STUBS


def test_stubs_match_the_proto(tmp_path: Path) -> None:
    # protoc runs in a process of its own: its C++ protobuf must not meet the libraries that
    # other tests loaded into this one
    subprocess.run(
        [sys.executable, "-m", "tandem.protos.generate", "--out", str(tmp_path)],
        check=True,
        cwd=ROOT,
        timeout=120,
    )
    for name in STUBS:
        fresh = (tmp_path / name).read_text()
        committed = (ROOT / "protos" / name).read_text()
        assert fresh == committed, f"protos/{name} is stale: run `python -m tandem.protos.generate`"


def test_service_is_described() -> None:
    from tandem.protos import tandem_pb2

    service = tandem_pb2.DESCRIPTOR.services_by_name["Tandem"]
    assert {m.name for m in service.methods} == {"Generate", "Abort", "ClusterStatus"}
    assert service.methods_by_name["Generate"].server_streaming
