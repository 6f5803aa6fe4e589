"""The layers written in ``pyproject.toml`` hold, and the check catches what breaks them: an
upward import, an import cycle and a frontend import of a torch-bearing model module, each
planted in a copy of the tree, fail ``lint-imports``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(tree: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(tree)}  # the copy's tandem/, not the installed one
    return subprocess.run(
        [str(LINT), "--no-cache"], cwd=tree, env=env, capture_output=True, text=True, timeout=300
    )


def _copy(tmp_path: Path) -> Path:
    tree = tmp_path / "tree"
    skip = shutil.ignore_patterns(".git", ".venv", "tests", "__pycache__", "*.safetensors", "demo")
    shutil.copytree(ROOT, tree, symlinks=True, ignore=skip)
    return tree


def test_the_tree_keeps_its_layers_and_has_no_cycle() -> None:
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "Contracts: 3 kept, 0 broken." in done.stdout


@pytest.mark.parametrize(
    ("file", "planted", "broken"),
    [
        # the wire, the lowest layer, reaching up to the controller
        (
            "wire/messages.py",
            "from tandem.cluster.pools import Cluster",
            "tandem.wire.messages -> tandem.cluster",
        ),
        # two modules of one package importing each other
        (
            "wire/framing.py",
            "from tandem.wire.messages import RankId",
            "No import cycles among sibling modules BROKEN",
        ),
        # the frontend reaching for the model's torch half (its grammar masks)
        (
            "frontend/core.py",
            "from tandem.model.grammar import GuidedRows",
            "tandem.frontend.core -> tandem.model.grammar",
        ),
    ],
    ids=["upward", "cycle", "frontend-torch"],
)
def test_a_planted_import_fails_the_check(tmp_path: Path, file: str, planted: str, broken: str) -> None:
    tree = _copy(tmp_path)
    if "cycle" in broken:  # the other half of the cycle
        path = tree / "wire" / "messages.py"
        path.write_text(path.read_text() + "\nfrom tandem.wire.framing import frame  # noqa: E402\n")
    path = tree / file
    path.write_text(path.read_text() + f"\n{planted}  # noqa: E402\n")
    done = _lint(tree)
    assert done.returncode == 1, done.stdout + done.stderr
    assert broken in done.stdout, done.stdout
