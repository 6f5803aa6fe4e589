"""Prometheus HTTP service discovery for a deployment: every scrape target (the frontend, the
controller, every rank of every live group) with its labels, and the scrape configuration that
points a Prometheus at it.

The document is the JSON list Prometheus' ``http_sd_configs`` reads::

    [{"targets": ["127.0.0.1:40211"], "labels": {"tandem_process": "rank", "role": "decode", ...}}, ...]

Targets change as groups start, fail, restart or stop: a rebuilt group's ranks appear with
their new incarnation and new ports, and Prometheus follows at its next refresh."""

from __future__ import annotations

from typing import Any

from tandem.wire.scrape_target import ScrapeTarget


def sd_document(targets: list[ScrapeTarget]) -> list[dict[str, Any]]:
    return [
        {"targets": [t.address], "labels": {"tandem_process": t.process, **t.labels}}
        for t in sorted(targets, key=lambda t: (t.process, t.address))
    ]


def prometheus_config(
    addr: str,
    scrape_interval_s: float = 5.0,
    refresh_s: float = 5.0,
    token_file: str | None = None,
    ca_file: str | None = None,
) -> str:
    """The scrape configuration, in YAML, for a deployment whose frontend serves ``/sd`` on
    ``addr`` (``HOST:PORT``). ``honor_labels`` keeps the labels each process puts on its own
    samples (they equal the discovery labels) instead of renaming them ``exported_*``. With
    ``token_file`` (the deployment's ``--metrics-token-file``) Prometheus sends its token to the
    discovery document and every target; with ``ca_file`` it speaks HTTPS to them, trusting it."""
    secure = ""
    if token_file is not None:
        secure += f"authorization:\n  type: Bearer\n  credentials_file: {token_file}\n"
    if ca_file is not None:
        secure += f"tls_config:\n  ca_file: {ca_file}\n"
    scheme = "https" if ca_file is not None else "http"
    job = "".join(f"    {line}\n" for line in secure.splitlines())
    sd = "".join(f"        {line}\n" for line in secure.splitlines())
    return (
        "global:\n"
        f"  scrape_interval: {_duration(scrape_interval_s)}\n"
        f"  evaluation_interval: {_duration(scrape_interval_s)}\n"
        "scrape_configs:\n"
        "  - job_name: tandem\n"
        "    honor_labels: true\n"
        + (f"    scheme: {scheme}\n" if ca_file is not None else "")
        + job
        + "    http_sd_configs:\n"
        f"      - url: {scheme}://{addr}/sd\n"
        f"        refresh_interval: {_duration(refresh_s)}\n" + sd
    )


def _duration(seconds: float) -> str:
    return f"{round(seconds * 1000)}ms"
