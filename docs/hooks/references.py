"""MkDocs hook: the reference pages rendered from the code that defines what they describe. A
page holds a marker line, ``<!-- generated: NAME -->``, that the rendered Markdown replaces."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]


def _cli() -> str:
    from tandem.cli.reference import cli_reference

    return cli_reference()


def _metrics() -> str:
    from tandem.metrics.reference import metrics_reference

    return metrics_reference()


def _topology() -> str:
    from tandem.cluster.topology_reference import topology_reference

    return topology_reference()


def _wire() -> str:
    """Each module of ``wire/`` with its docstring: what crosses between processes."""
    parts = []
    for path in sorted((ROOT / "wire").glob("*.py")):
        if path.name == "__init__.py":
            continue
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
        parts += [f"## `wire/{path.name}`", "", doc, ""]
    return "\n".join(parts)


RENDERERS: dict[str, Callable[[], str]] = {
    "cli": _cli,
    "metrics": _metrics,
    "topology": _topology,
    "wire": _wire,
}


def on_page_markdown(markdown: str, **_: Any) -> str:
    for name, render in RENDERERS.items():
        marker = f"<!-- generated: {name} -->"
        if marker in markdown:
            markdown = markdown.replace(marker, render())
    return markdown
