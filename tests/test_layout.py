"""The repository's layout: its folders install under one ``tandem`` package, nothing generic
lands in site-packages, and the processes that never run the model never import torch."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _package_folders() -> list[Path]:
    """Every folder of the repository that is a Python package, tests and the ``tandem/`` links
    aside, and what git ignores (virtual environments, builds) too."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "--", "*__init__.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    if listed.returncode == 0:
        inits = [ROOT / line for line in listed.stdout.splitlines() if "/" in line]
    else:  # not a git checkout: the folders a checkout would hold
        inits = list(ROOT.glob("*/**/__init__.py"))
    return sorted(
        p.parent.relative_to(ROOT)
        for p in inits
        if p.exists() and p.parts[len(ROOT.parts)] not in ("tests", "tandem", ".venv", "build")
    )


def test_every_package_folder_installs_under_tandem() -> None:
    setuptools = PYPROJECT["tool"]["setuptools"]
    folders = _package_folders()
    assert folders, "no package folder found"
    for folder in folders:
        name = "tandem." + ".".join(folder.parts)
        assert name in setuptools["packages"], f"{folder}/ is not installed: add {name!r} to packages"
        top = folder.parts[0]
        assert setuptools["package-dir"][f"tandem.{top}"] == top
        # the checkout's tandem/ links give tools that read the tree the installed names
        assert (ROOT / "tandem" / top).resolve() == (ROOT / top).resolve()
    assert set(setuptools["packages"]) == {"tandem"} | {"tandem." + ".".join(f.parts) for f in folders}


def test_lint_bans_a_bare_import_of_every_package() -> None:
    banned = PYPROJECT["tool"]["ruff"]["lint"]["flake8-tidy-imports"]["banned-api"]
    assert "TID251" in PYPROJECT["tool"]["ruff"]["lint"]["select"]
    assert {f.parts[0] for f in _package_folders()} <= set(banned)


def test_only_tandem_is_importable_outside_the_checkout(tmp_path: Path) -> None:
    tops = sorted({f.parts[0] for f in _package_folders()})
    code = (
        "import importlib.util, tandem.router, tandem.cli.main\n"
        f"leaked = [m for m in {tops!r} if importlib.util.find_spec(m) is not None]\n"
        "assert not leaked, f'top-level modules in the environment: {leaked}'\n"
    )
    # run from elsewhere: inside the checkout the folders are importable by their own names
    subprocess.run([sys.executable, "-c", code], check=True, cwd=tmp_path)
    bare = subprocess.run(
        [sys.executable, "-c", "import model"], cwd=tmp_path, capture_output=True, text=True
    )
    assert bare.returncode != 0 and "No module named 'model'" in bare.stderr


# the processes that never run the model: the frontend, the controller, the CLI; and what they
# import to describe ranks and talk to them
TORCH_FREE = (
    "tandem.wire.messages",
    "tandem.wire.request_params",
    "tandem.wire.prefill_job",
    "tandem.wire.kv_events",
    "tandem.wire.stream_summary",
    "tandem.wire.routing_view",
    "tandem.wire.autoscaler_decision",
    "tandem.wire.scrape_target",
    "tandem.wire.framing",
    "tandem.client.grpc_client",
    "tandem.client.prompts",
    "tandem.client.output",
    "tandem.cli.serving",
    "tandem.cli.serving_parsers",
    "tandem.cli.deployment",
    "tandem.cli.plan",
    "tandem.cluster.memory_plan",
    "tandem.model.rank_weights",
    "tandem.model.dtype_names",
    "tandem.model.page_kinds",
    "tandem.model.v4.kv_layout",
    "tandem.frontend.core",
    "tandem.frontend.membership",
    "tandem.frontend.migration",
    "tandem.engine.outbox",
    "tandem.engine.kv_event_publisher",
    "tandem.cluster.outbox",
    "tandem.frontend.actor",
    "tandem.frontend.grpc_service",
    "tandem.router.router",
    "tandem.cluster.controller",
    "tandem.cluster.serve",
    "tandem.cluster.deployment",
    "tandem.cluster.node_roles",
    "tandem.cluster.rank_actor",
    "tandem.cli.main",
    "tandem.cli.generate",
    "tandem.prefill.role",
    "tandem.decode.role",
    "tandem.engine.colocated_role",
    "tandem.kvtransfer.transport",
    "tandem.kvtransfer.types",
    "tandem.kvtransfer.metadata",
    "tandem.kvtransfer.descriptors",
    "tandem.kvtransfer.regions",
    "tandem.engine.slot_owners",
    "tandem.decode.slot_handoff",
    "tandem.metrics.frontend",
    "tandem.metrics.rank",
    "tandem.metrics.controller",
    "tandem.metrics.http",
    "tandem.metrics.discovery",
    "tandem.metrics.catalog",
    "tandem.autoscaler.policy",
)


def test_processes_that_never_run_the_model_do_not_import_torch() -> None:
    code = (
        "import importlib, sys\n"
        f"for name in {TORCH_FREE!r}:\n"
        "    importlib.import_module(name)\n"
        "    heavy = [m for m in ('torch', 'tandem.model.deepseek') if m in sys.modules]\n"
        "    assert not heavy, f'importing {name} loaded {heavy}'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_architecture_page_names_every_module() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    modules = [
        p.relative_to(ROOT).as_posix()
        for folder in _package_folders()
        for p in sorted((ROOT / folder).glob("*.py"))
        if p.name != "__init__.py" and not p.name.startswith("tandem_pb2")
    ]
    assert modules
    missing = [m for m in modules if f"`{m}`" not in page]
    assert not missing, f"docs/architecture.md has no line for {missing}"


def test_mypy_sees_the_installed_names_in_the_checkout(tmp_path: Path) -> None:
    """A type error across ``tandem.*`` modules fails mypy: the names resolve to the checkout's
    code (through ``tandem/``), not to unknown modules that would type as ``Any``."""
    planted = tmp_path / "planted.py"
    planted.write_text("from tandem.router.router import Router\n\nx: int = Router().counters()\n")
    run = subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(tmp_path / "cache"), str(planted)],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1 and 'expression has type "dict[str, int]"' in run.stdout, run.stdout
