"""The frontend never loads torch: every frontend module, and each torch-free module of the engine
and the model that the import contract lets it use, imported in a fresh interpreter, leaves no
``torch`` in ``sys.modules``. (The contract, in pyproject.toml, says which modules those are;
this says they really are torch-free, whatever they import.)"""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _allowed() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    (contract,) = [
        c
        for c in config["tool"]["importlinter"]["contracts"]
        if c["name"].startswith("The frontend imports no")
    ]
    return [rule.split(" -> ")[1] for rule in contract["ignore_imports"]]


def test_the_frontend_and_the_modules_it_may_use_import_no_torch() -> None:
    frontend = [f"tandem.frontend.{p.stem}" for p in sorted((ROOT / "frontend").glob("*.py"))]
    modules = frontend + _allowed()
    assert "tandem.model.grammar_compiler" in modules and "tandem.frontend.core" in modules
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", out.stdout
