"""Regenerate the Python stubs of ``protos/tandem.proto``: ``python -m tandem.protos.generate``.

The stubs are committed; ``tests/protos/test_stubs.py`` fails when they differ from what this
writes. ``--out DIR`` writes them elsewhere (the test compares such a copy).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PROTO = "protos/tandem.proto"
STUBS = ("tandem_pb2.py", "tandem_pb2.pyi", "tandem_pb2_grpc.py")


def generate(out_dir: Path) -> list[Path]:
    """Write the stubs into ``out_dir`` (as ``out_dir/<stub>``); the paths written."""
    from grpc_tools import protoc

    include = Path(protoc.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        # the proto is compiled as ``tandem/protos/tandem.proto`` so that the stubs import each
        # other as ``tandem.protos.tandem_pb2``, the name the package installs under
        src = Path(tmp) / "src"
        (src / "tandem" / "protos").mkdir(parents=True)
        shutil.copyfile(ROOT / PROTO, src / "tandem" / PROTO)
        build = Path(tmp) / "build"
        build.mkdir()
        args = [
            "protoc",
            f"-I{src}",
            f"-I{include}",
            f"--python_out={build}",
            f"--pyi_out={build}",
            f"--grpc_python_out={build}",
            str(src / "tandem" / PROTO),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {PROTO}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for name in STUBS:
            target = out_dir / name
            shutil.copyfile(build / "tandem" / "protos" / name, target)
            written.append(target)
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "protos")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
