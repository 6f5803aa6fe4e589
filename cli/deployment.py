"""``tandem status``, ``tandem stop`` and ``tandem serve --dry-run``: a deployment on a Ray
cluster, from any machine that can reach the cluster."""

from __future__ import annotations

import argparse
import json
import re
from collections.abc import Callable
from typing import Any

from tandem.client.output import emit
from tandem.wire.request_params import InvalidRequestError

NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,38}[a-z0-9])?$")


def add_deployment_parsers(sub: Any) -> None:
    st = sub.add_parser("status", help="a deployment on a Ray cluster: what runs where")
    sp = sub.add_parser("stop", help="stop a (detached) deployment; nothing of it is left")
    for p in (st, sp):
        p.add_argument("--address", required=True, help="the Ray cluster (auto, or HOST:PORT of its GCS)")
        p.add_argument("--name", default="tandem", help="the deployment's name (default: tandem)")


def check_name(name: str) -> str:
    if not NAME.match(name):
        raise InvalidRequestError(
            "--name", f"expected lower-case letters, digits and '-' (at most 40), got {name!r}"
        )
    return name


def _on_cluster(args: argparse.Namespace, action: Callable[[str, str], Any]) -> Any:
    """``action(name, address)`` connected to the deployment's namespace; a deployment that is
    not there is bad input, one that does not answer is a one-line error (exit 1)."""
    import ray

    from tandem.cluster import deployment
    from tandem.cluster.ray_bootstrap import init_ray, shutdown_ray

    name = check_name(args.name)
    init_ray(args.address, namespace=name)
    try:
        return action(name, args.address)
    except deployment.NoDeployment as exc:
        raise InvalidRequestError("--name", str(exc).removeprefix("--name: ")) from None
    except (ray.exceptions.RayError, TimeoutError) as exc:
        lines = str(exc).strip().splitlines()
        raise DeploymentUnreachable(
            f"deployment {name}: {lines[-1] if lines else type(exc).__name__}"
        ) from None
    finally:
        shutdown_ray()


class DeploymentUnreachable(RuntimeError):
    """The deployment is there but did not answer (its controller died, or its node)."""


def run_status(args: argparse.Namespace) -> int:
    from tandem.cluster import deployment

    emit(json.dumps(_on_cluster(args, deployment.status), indent=2))
    return 0


def run_stop(args: argparse.Namespace) -> int:
    from tandem.cluster import deployment

    name = args.name
    stopped = _on_cluster(args, deployment.stop)
    emit(
        f"tandem: stopped {name}: {stopped['frontends']} frontends, the controller and "
        f"{stopped['ranks']} ranks; no placement group left"
    )
    return 0


def run_dry_run(topology: Any, address: str | None, name: str) -> int:
    """Print where every group would go; exit 1 when one cannot be placed. Starts nothing
    (without ``address`` it looks at the Ray this command would start)."""
    from tandem.cluster.deployment import dry_run
    from tandem.cluster.ray_bootstrap import init_ray, shutdown_ray

    init_ray(address, namespace=name)
    try:
        plans = dry_run(topology)
    finally:
        shutdown_ray()
    emit(f"tandem: {topology.describe()}, deployment {name}: where each group would go")
    for p in plans:
        emit(f"  {p.describe()}")
    return 0 if all(p.problem is None for p in plans) else 1
