"""The README is short and starts with the two commands; the documentation site's pages that
are rendered from the code name what the code defines (the site's strict build is in
``.ci/run``)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from tandem.cli.reference import cli_reference
from tandem.cluster.topology import PoolSpec
from tandem.metrics.catalog import exported_metric_names
from tandem.metrics.reference import metrics_reference

ROOT = Path(__file__).resolve().parent.parent


def test_the_readme_is_short_and_opens_with_the_two_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 15 * 1024
    first_code = re.findall(r"```(\w*)\n(.*?)\n```", readme, re.S)[:2]
    assert [lang for lang, _ in first_code] == ["bash", "bash"]
    (_, main_job), (_, tests) = first_code
    assert "tandem serve" in main_job and "tandem client generate" in main_job
    assert "apt-get install" in tests and "mkdocs build --strict" in tests and "pytest" in tests
    install = (ROOT / "docs" / "getting-started" / "install.md").read_text()
    assert main_job in install and tests in install


def test_the_cli_reference_names_every_command_and_its_flags() -> None:
    page = cli_reference()
    for command in ("tandem serve", "tandem client generate", "tandem bench serve", "tandem plan memory"):
        assert f"## {command}\n" in page
    for flag in ("`--kv-store-secret-file`", "`--metrics-token-file`", "`--grammar-compile-limit`"):
        assert flag in page


def test_the_metrics_reference_lists_every_exported_family() -> None:
    page = metrics_reference()
    rows = set(re.findall(r"^\| `(tandem_\w+)` \|", page, re.M))
    exported = set().union(*exported_metric_names().values())
    families = {re.sub(r"_(bucket|sum|count)$", "", name) for name in exported}
    assert families <= rows, families - rows
    assert "tandem_kv_store_slow_fetches_total" in rows


def test_the_topology_and_wire_pages_render_from_the_code() -> None:
    spec = importlib.util.spec_from_file_location("references", ROOT / "docs" / "hooks" / "references.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.on_page_markdown("# T\n\n<!-- generated: topology -->\n<!-- generated: wire -->\n")
    for field in PoolSpec.model_fields:
        assert f"| `{field}` |" in page
    assert "## `wire/block_chain.py`" in page and "<!-- generated" not in page
