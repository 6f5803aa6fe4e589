"""The topology file's reference page, rendered from its schema (``cluster/topology.py``'s
pydantic models: every field, its type, default and description) and the presets in
``deploy/presets``. The docs site's hook puts it in ``docs/reference/topology.md``."""

from __future__ import annotations

import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from tandem.cluster.topology import Topology

PRESETS = Path(__file__).resolve().parent.parent / "deploy" / "presets"


def _models(annotation: object) -> list[type[BaseModel]]:
    """The models an annotation names (``PoolSpec``, ``PoolSpec | None``, ``dict[str, PoolBounds]``)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _type_name(annotation: object) -> str:
    text = getattr(annotation, "__name__", None) if isinstance(annotation, type) else None
    return text or str(annotation).replace("typing.", "").replace("tandem.cluster.topology.", "")


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def _section(model: type[BaseModel], path: str, seen: set[type[BaseModel]]) -> list[str]:
    parts = [f"## `{path}`", ""]
    if model.__doc__:
        parts += [_cell(model.__doc__), ""]
    parts += ["| field | type | default | what |", "|---|---|---|---|"]
    nested: list[tuple[type[BaseModel], str]] = []
    for name, info in model.model_fields.items():
        default = "" if info.default is PydanticUndefined else f"`{info.default!r}`"
        if info.default_factory is not None:
            default = "(its own defaults)"
        kind, what = _cell(_type_name(info.annotation)), _cell(info.description or "")
        parts.append(f"| `{name}` | `{kind}` | {_cell(default)} | {what} |")
        nested += [(sub, f"{path}.{name}") for sub in _models(info.annotation) if sub not in seen]
        seen |= {sub for sub, _ in nested}
    parts.append("")
    for sub, sub_path in nested:
        parts += _section(sub, sub_path, seen)
    return parts


def topology_reference() -> str:
    """The page's Markdown (its title is the page's own)."""
    parts = [
        "A topology is a YAML file (`--topology FILE`) or a preset (`--preset NAME`); unknown",
        "fields are refused, naming the field. Rendered from the schema.",
        "",
        "Presets: " + ", ".join(f"`{p.stem}`" for p in sorted(PRESETS.glob("*.yaml"))),
        "",
    ]
    return "\n".join(parts + _section(Topology, "topology", {Topology}))
