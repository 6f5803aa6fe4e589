"""Ray start-up: an embedded Ray by default, or an existing cluster with ``address``."""

from __future__ import annotations

import logging
import os

import ray

from tandem.kvtransfer.ucx_config import TRANSFER_ENV_KEYS, single_host_transfer_env


def init_ray(address: str | None = None, num_cpus: int | None = None, namespace: str | None = None) -> None:
    """Connect to ``address`` (``auto`` or ``host:port``), or start Ray inside this process; in
    ``namespace`` (a deployment's name: its named actors live there).

    The ranks get this process's ``TANDEM_``, ``TRITON_`` and ``UCX_`` variables, and on an
    embedded Ray the single-host transfer setting (:mod:`kvtransfer.ucx_config`).

    Idempotent: a process already connected keeps its connection.
    """
    if ray.is_initialized():
        return
    env = {
        k: v
        for k, v in os.environ.items()
        if k.startswith(("TANDEM_", "TRITON_", "UCX_")) or k in TRANSFER_ENV_KEYS
    }
    # an embedded Ray is one host: its ranks get the single-host transfer setting (the operator's wins)
    env.update(single_host_transfer_env(os.environ, single_host=not address))
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
