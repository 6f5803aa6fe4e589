"""NIXL transfer speed between two Ray actors against memcpy of the same bytes, in one run, with
the UCX transports actually selected.

Two :class:`bench.kv_peer.KVPeer` actors (separate processes) each own a pool of ``size_mib``
MiB (8 layers, pages of 64 tokens x 512 float32 = 128 KiB, so one page of every layer is 1 MiB).
The prefill side sends every page of every layer to the decode side: whole-request (one transfer)
and layer-wise (one transfer per layer), with source and destination pages in order (so each
layer is one descriptor) and shuffled (one descriptor per page). Each figure is the median of
``repeats`` runs, timed in the sending process from the first post to the transport reporting
the send complete (it polls there: no Ray call falls inside). memcpy copies the same number of
bytes between two touched buffers inside the sending process, on one thread as the rank runs.

The actors run with the environment a deployment's ranks get (:mod:`kvtransfer.ucx_config`: the
single-host setting when no ``address`` is given) plus ``UCX_PROTO_INFO`` written to a log file,
from which the sender's selected protocols are read (``ucx_transports``).
"""

from __future__ import annotations

import glob
import os
import random
import statistics
import tempfile
from pathlib import Path
from typing import Any

import ray

from tandem.bench.kv_peer import KVPeer
from tandem.cluster.ray_bootstrap import init_ray, shutdown_ray
from tandem.kvtransfer.types import KVDestination
from tandem.kvtransfer.ucx_config import TRANSFER_ENV_KEYS, selected_transports, single_host_transfer_env

LAYERS, PAGE_SIZE, DIM = 8, 64, 512
PREFILL, DECODE = "bench-prefill", "bench-decode"


def _one(prefill: Any, decode: Any, rid: str, src: list[int], dst: list[int], layerwise: bool) -> float:
    ray.get(decode.expect.remote(rid, PREFILL, dst, 60.0))
    # the decode side polls meanwhile, as its rank loop does (first contact needs its progress)
    received = decode.poll.remote(60.0)
    dest = KVDestination(DECODE, 1, tuple(dst))
    stats = ray.get(prefill.send_timed.remote(rid, dest, src, layerwise, 60.0))
    got = ray.get(received)
    if rid not in got.received:
        problem = got.failed[rid].error if rid in got.failed else "no notification"
        raise RuntimeError(f"transfer {rid} on the decode side: {problem}")
    return float(stats.gb_s)


def _ucx_env(single_host: bool) -> dict[str, str]:
    """The transfer environment the ranks of a deployment get: the operator's, else Tandem's."""
    env = {k: v for k, v in os.environ.items() if k.startswith("UCX_") or k in TRANSFER_ENV_KEYS}
    return {**env, **single_host_transfer_env(os.environ, single_host)}


def measure_transfer(size_mib: int = 256, repeats: int = 3, address: str | None = None) -> dict[str, Any]:
    """NIXL against memcpy of the same bytes, whole-request and layer-wise, with the transports UCX
    selected. Starts (and stops) an embedded Ray unless one is running or ``address`` is given."""
    if not isinstance(size_mib, int) or size_mib < 1:
        raise ValueError(f"size_mib: expected a whole number of MiB >= 1, got {size_mib!r}")
    if not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats: expected a whole number >= 1, got {repeats!r}")
    started = not ray.is_initialized()
    init_ray(address)
    env = _ucx_env(single_host=not address)
    pages = size_mib  # one page of every layer is 1 MiB
    with tempfile.TemporaryDirectory(prefix="tandem-ucx-") as log_dir:
        diagnostics = {"UCX_PROTO_INFO": "y", "UCX_LOG_FILE": os.path.join(log_dir, "ucx.%p.log")}
        make = KVPeer.options(runtime_env={"env_vars": {**env, **diagnostics}}).remote  # type: ignore[attr-defined]
        peers = [make(name, 1, LAYERS, pages, PAGE_SIZE, DIM) for name in (PREFILL, DECODE)]
        prefill, decode = peers
        try:
            prefill_pid = ray.get(prefill.pid.remote())
            src = ray.get(prefill.allocate.remote(pages))
            dst = ray.get(decode.allocate.remote(pages))
            ray.get(prefill.fill.remote(src, 0))
            shuffled = random.Random(0).sample(dst, len(dst))
            _one(prefill, decode, "warmup", src, dst, False)
            results: dict[str, float] = {}
            for name, layerwise, targets in [
                ("whole_request", False, dst),
                ("layerwise", True, dst),
                ("whole_request_shuffled_pages", False, shuffled),
            ]:
                results[name] = statistics.median(
                    _one(prefill, decode, f"{name}-{i}", src, targets, layerwise) for i in range(repeats)
                )
            correct = ray.get(decode.read.remote(shuffled)) == ray.get(prefill.read.remote(src))
            nbytes = pages * LAYERS * PAGE_SIZE * DIM * 4
            memcpy = float(ray.get(prefill.memcpy_gb_s.remote(nbytes)))
        finally:
            for peer in peers:
                ray.kill(peer)
            if started:
                shutdown_ray()
        log = "".join(
            Path(path).read_text() for path in glob.glob(os.path.join(log_dir, f"ucx.{prefill_pid}.log*"))
        )
    transports = selected_transports(log)
    return {
        "size_mib": size_mib,
        "repeats": repeats,
        "nixl_gbps": round(results["whole_request"], 3),
        "memcpy_gbps": round(memcpy, 3),
        "nixl_over_memcpy": round(results["whole_request"] / memcpy, 3),
        "layerwise_nixl_gbps": round(results["layerwise"], 3),
        "layerwise_nixl_over_memcpy": round(results["layerwise"] / memcpy, 3),
        "shuffled_pages_nixl_gbps": round(results["whole_request_shuffled_pages"], 3),
        "bytes_match": correct,
        "layout": {"layers": LAYERS, "pages": pages, "page_bytes": PAGE_SIZE * DIM * 4},
        "ucx_transports": transports.as_dict() if transports.writes else "not reported by UCX",
        "ucx_env": env,
    }


def run_kvtransfer_bench(size_mib: int = 256, repeats: int = 3, address: str | None = None) -> dict[str, Any]:
    """``tandem bench kvtransfer``: :func:`measure_transfer` under its earlier names too."""
    result = measure_transfer(size_mib, repeats, address)
    return {
        **result,
        "nixl_gb_s": result["nixl_gbps"],
        "memcpy_gb_s": result["memcpy_gbps"],
        "ratio": result["nixl_over_memcpy"],
        "layerwise_gb_s": result["layerwise_nixl_gbps"],
        "shuffled_pages_gb_s": result["shuffled_pages_nixl_gbps"],
    }
