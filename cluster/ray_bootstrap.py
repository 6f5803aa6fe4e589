"""Ray start-up: an embedded Ray by default, or an existing cluster with ``address``."""

from __future__ import annotations

import logging
import os

import ray


def init_ray(address: str | None = None, num_cpus: int | None = None, namespace: str | None = None) -> None:
    """Connect to ``address`` (``auto`` or ``host:port``), or start Ray inside this process; in
    ``namespace`` (a deployment's name: its named actors live there).

    Idempotent: a process already connected keeps its connection.
    """
    if ray.is_initialized():
        return
    env = {k: v for k, v in os.environ.items() if k.startswith(("TANDEM_", "TRITON_", "UCX_"))}
    runtime_env = {"env_vars": env} if env else None
    if address:
        ray.init(
            address=address,
            namespace=namespace,
            runtime_env=runtime_env,
            logging_level=logging.WARNING,
            log_to_driver=os.environ.get("TANDEM_RAY_LOGS") == "1",
        )
    else:
        ray.init(
            num_cpus=num_cpus or os.cpu_count() or 1,
            include_dashboard=False,
            namespace=namespace,
            runtime_env=runtime_env,
            logging_level=logging.WARNING,
            log_to_driver=os.environ.get("TANDEM_RAY_LOGS") == "1",
        )


def shutdown_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()
