"""Ray start-up: an embedded Ray by default, or an existing cluster with ``address``."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from typing import Any

import ray

from tandem.kvtransfer.ucx_config import TRANSFER_ENV_KEYS, single_host_transfer_env

logger = logging.getLogger(__name__)


def init_ray(address: str | None = None, num_cpus: int | None = None, namespace: str | None = None) -> None:
    """Connect to ``address`` (``auto`` or ``host:port``), or start Ray inside this process on the
    loopback address; in ``namespace`` (a deployment's name: its named actors live there).

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
        _start_embedded(num_cpus or os.cpu_count() or 1, namespace, runtime_env)


# Ray gives a starting raylet a fixed 30 s to register with its GCS; on a loaded host (the
# processes of a Ray just shut down still exiting) that can pass. The half-started node is
# killed and the start tried once more.
_STARTUP_TIMEOUT = "timed out during startup"
_EMBEDDED_ATTEMPTS = 2


# Ray resolves a node's address to the host's outward address, even when told "127.0.0.1"; with
# this variable at 0 it takes the loopback address instead (what it does by default on macOS and
# Windows). An embedded Ray is one host: its GCS, raylet and agents then listen on loopback, and
# every process of the deployment (ranks' channels, rendezvous, metrics) finds 127.0.0.1 as its
# node's address. Ray's own gRPC servers still bind every interface; Ray's token authentication
# (on by default) is what protects them.
_LOOPBACK_NODE_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@contextlib.contextmanager
def _loopback_node() -> Iterator[None]:
    """While Ray starts: the GCS, raylet and agents it spawns inherit the setting (and the
    workers the raylet spawns, from it); this process read it at import. Put back afterwards,
    so a later ``ray.init``/``ray start`` of this process (a cluster) is not affected."""
    from ray._private import ray_constants

    env, enabled = os.environ.get(_LOOPBACK_NODE_ENV), ray_constants.ENABLE_RAY_CLUSTER
    os.environ[_LOOPBACK_NODE_ENV] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        if env is None:
            os.environ.pop(_LOOPBACK_NODE_ENV, None)
        else:
            os.environ[_LOOPBACK_NODE_ENV] = env
        ray_constants.ENABLE_RAY_CLUSTER = enabled


def _start_embedded(num_cpus: int, namespace: str | None, runtime_env: dict[str, Any] | None) -> None:
    for attempt in range(1, _EMBEDDED_ATTEMPTS + 1):
        try:
            with _loopback_node():
                ray.init(
                    num_cpus=num_cpus,
                    include_dashboard=False,
                    namespace=namespace,
                    runtime_env=runtime_env,
                    logging_level=logging.WARNING,
                    log_to_driver=os.environ.get("TANDEM_RAY_LOGS") == "1",
                )
            return
        except Exception as e:
            if _STARTUP_TIMEOUT not in str(e) or attempt == _EMBEDDED_ATTEMPTS:
                raise
            _kill_half_started_node(e)
            logger.warning("embedded Ray did not start in time (attempt %d); starting it again", attempt)


def _kill_half_started_node(error: BaseException) -> None:
    """Kill the GCS and raylet of the node whose start raised ``error``: ``ray.init`` drops the
    node object when its constructor raises, so it is found in the traceback."""
    from ray._private.node import Node

    tb = error.__traceback__
    while tb is not None:
        node = tb.tb_frame.f_locals.get("self")
        if isinstance(node, Node):
            node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)
            return
        tb = tb.tb_next


def shutdown_ray() -> None:
    if ray.is_initialized():
        ray.shutdown()
