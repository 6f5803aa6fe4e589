"""NIXL transfer speed between two Ray actors against memcpy of the same bytes, in one run.

Two :class:`bench.kv_peer.KVPeer` actors (separate processes) each own a pool of ``size_mib``
MiB (8 layers, pages of 64 tokens x 512 float32 = 128 KiB, so one page of every layer is 1 MiB).
The prefill side sends every page of every layer to the decode side: whole-request (one transfer)
and layer-wise (one transfer per layer), with source and destination pages in order (so each
layer is one descriptor) and shuffled (one descriptor per page). Each figure is the median of
``repeats`` runs, timed from the first post to the transport reporting the send complete.
memcpy copies the same number of bytes between two touched buffers inside the sending process.
"""

from __future__ import annotations

import os
import random
import statistics
import time
from typing import Any

import ray

from tandem.bench.kv_peer import KVPeer, PeerEvents
from tandem.cluster.ray_bootstrap import init_ray
from tandem.kvtransfer.types import KVDestination

LAYERS, PAGE_SIZE, DIM = 8, 64, 512


def _one(prefill: Any, decode: Any, rid: str, src: list[int], dst: list[int], layerwise: bool) -> float:
    ray.get(decode.expect.remote(rid, "bench-prefill", dst, 60.0))
    dest = KVDestination("bench-decode", 1, tuple(dst))
    ray.get(prefill.send.remote(rid, dest, src, layerwise, 60.0, release=False))
    sent: PeerEvents | None = None
    deadline = time.monotonic() + 120
    done = {"send": False, "recv": False}
    while not all(done.values()):
        if time.monotonic() > deadline:
            raise TimeoutError(f"transfer {rid} did not finish")
        s, r = ray.get([prefill.poll.remote(0.01), decode.poll.remote(0.01)])
        if rid in s.failed or rid in r.failed:
            raise RuntimeError(f"transfer {rid} failed: {(s.failed | r.failed)[rid].error}")
        if rid in s.sent:
            done["send"], sent = True, s
        done["recv"] = done["recv"] or rid in r.received
    assert sent is not None
    return float(sent.sent[rid].gb_s)


def run_kvtransfer_bench(size_mib: int = 256, repeats: int = 3, address: str | None = None) -> dict[str, Any]:
    init_ray(address)
    pages = size_mib  # one page of every layer is 1 MiB
    make = KVPeer.remote  # type: ignore[attr-defined]
    peers = [make(name, 1, LAYERS, pages, PAGE_SIZE, DIM) for name in ("bench-prefill", "bench-decode")]
    prefill, decode = peers
    try:
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
        memcpy = ray.get(prefill.memcpy_gb_s.remote(nbytes))
    finally:
        for peer in peers:
            ray.kill(peer)
    best = results["whole_request"]
    return {
        "size_mib": size_mib,
        "nixl_gb_s": round(best, 3),
        "memcpy_gb_s": round(memcpy, 3),
        "ratio": round(best / memcpy, 3),
        "layerwise_gb_s": round(results["layerwise"], 3),
        "shuffled_pages_gb_s": round(results["whole_request_shuffled_pages"], 3),
        "bytes_match": correct,
        "repeats": repeats,
        "layout": {"layers": LAYERS, "pages": pages, "page_bytes": PAGE_SIZE * DIM * 4},
        "ucx_tls": os.environ.get("UCX_TLS", "UCX default selection (shared memory and TCP on one host)"),
    }
