"""Where the calling process runs: its Ray node, the node's labels and its process id."""

from __future__ import annotations

import os

import ray

from tandem.wire.messages import ProcessPlace


def this_place() -> ProcessPlace:
    """Where the calling process runs (it must be connected to Ray)."""
    context = ray.get_runtime_context()
    labels = {k: str(v) for k, v in (context.get_node_labels() or {}).items() if not k.startswith("ray.io/")}
    address = ray.util.get_node_ip_address()
    return ProcessPlace(context.get_node_id(), address, tuple(sorted(labels.items())), os.getpid())
