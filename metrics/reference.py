"""The metrics reference page, rendered from the registries that export the metrics
(``metrics/catalog.py``): each family by process kind, with its type, labels and help. The docs
site's hook puts it in ``docs/reference/metrics.md``, so the page cannot drift from the code."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from tandem.metrics.catalog import exported_registries

_KINDS = {
    "frontend": "Each frontend (`--metrics-port`, frontend *i* on the port + *i*).",
    "rank": "Each prefill and decode rank (on the ports the frontend's `/sd` document lists).",
    "controller": "The controller: its groups and the autoscaler.",
}
_BUCKET_LABELS = {"le", "quantile"}


def _declared_labels(registry: CollectorRegistry) -> dict[str, set[str]]:
    """Label names as each metric declares them (a family with no series yet shows none)."""
    out: dict[str, set[str]] = {}
    for collector in list(getattr(registry, "_collector_to_names", {})):
        name, labels = getattr(collector, "_name", None), getattr(collector, "_labelnames", None)
        if name is not None and labels is not None:
            out[str(name)] = set(labels)
    return out


def _families(registries: list[CollectorRegistry]) -> dict[str, tuple[str, str, set[str]]]:
    """name -> (type, help, label names), over every registry of one process kind."""
    out: dict[str, tuple[str, str, set[str]]] = {}
    for registry in registries:
        declared = _declared_labels(registry)
        for family in registry.collect():
            labels = {name for sample in family.samples for name in sample.labels} - _BUCKET_LABELS
            labels |= declared.get(family.name, set())
            kind, help_text, known = out.get(family.name, (family.type, family.documentation, set()))
            out[family.name] = (kind, help_text, known | labels)
    return out


def _name(family: str, kind: str) -> str:
    return f"{family}_total" if kind == "counter" else family


def metrics_reference() -> str:
    """The page's Markdown (its title is the page's own)."""
    parts = [
        "Every Prometheus metric Tandem exports, by the process that exports it, rendered from",
        "the registries that define them. Every series also carries the process's identity",
        "labels (`model`, and the frontend's, rank's or controller's own).",
        "",
    ]
    for kind, registries in exported_registries().items():
        parts += [f"## {kind.capitalize()}", "", _KINDS[kind], "", "| metric | type | labels | what |"]
        parts += ["|---|---|---|---|"]
        for family, (mtype, help_text, labels) in sorted(_families(registries).items()):
            shown = ", ".join(f"`{label}`" for label in sorted(labels))
            what = " ".join(help_text.split()).replace("|", "\\|")
            parts.append(f"| `{_name(family, mtype)}` | {mtype} | {shown} | {what} |")
        parts.append("")
    return "\n".join(parts)
