"""How NIXL's UCX backend moves KV between two ranks of one host, and what UCX reports it chose.

What UCX picks for a NIXL WRITE (a ``ucp_put`` into the peer's registered pool), measured on a
2-core machine with UCX 1.23 (NIXL 1.5.1), 256 MiB pools, ``UCX_PROTO_INFO=y``:

- host memory, same host: **cma** (``process_vm_writev``: the kernel copies once, straight from
  this pool into the peer's, nothing staged), zero-copy for every size. UCX chooses it by itself;
  no ``UCX_TLS`` is needed. posix/sysv shared memory never carry these writes: they cannot reach
  memory UCX did not allocate (no xpmem/knem here), NIXL asks for peer error handling (which they
  lack), and forcing them (error mode ``none``, ``UCX_TLS=posix,self,tcp``) emulates each put with
  active messages through the receiver's progress: 1.1 GB/s. ``UCX_TLS=tcp,self``: 1.3-1.9 GB/s.
  Rendezvous settings (``UCX_RNDV_*``) do not apply: puts have no rendezvous.
- what limits cma is the kernel pinning the peer's pages, one 4 KiB page at a time. With the
  pools in transparent huge pages (torch's ``THP_MEM_ALLOC_ENABLE=1``: its CPU allocator aligns
  tensors of 2 MiB and more to 2 MiB and asks the kernel for huge pages), ``tandem bench
  kvtransfer --size-mib 256`` (two Ray actors, memcpy in the sender, each run side by side):

  ========================  =================  ===============  ===================
  setting                   whole-request       layer-wise       memcpy
  ========================  =================  ===============  ===================
  4 KiB pages               7.1-8.1 GB/s        7.7 GB/s         11.2-14.0 GB/s
                            (0.58-0.64)         (0.55-0.69)
  huge pages (default)      11.5-12.5 GB/s      11.5-12.6 GB/s   12.2-12.6 GB/s
                            (0.94-0.99)         (0.93-1.00)
  ========================  =================  ===============  ===================

- NIXL's progress thread (off in :mod:`kvtransfer.nixl_transport`) spins a core per agent: with it
  on (huge pages too), 6.5 GB/s whole-request (0.50).

So on one host Tandem asks for huge pages and leaves the transport to UCX (cma for host memory,
cuda_ipc for device memory: a ``UCX_TLS`` without the CUDA transports would stop VRAM pools).
UCX's TCP transport, which wires the endpoints up, listens on every network device's address;
on one host it is kept to the loopback device (``UCX_NET_DEVICES=lo``: cma and cuda_ipc are not
network devices, and are not affected), so no rank's agent listens beyond loopback.
Across nodes nothing is forced: UCX picks RDMA where the nodes have it. Whatever the operator set
in the environment wins, key by key.

UCX's modules (``configure_ucx``, run before NIXL loads UCX): on a machine without RDMA devices
(no entry under ``/sys/class/infiniband``) UCX's InfiniBand modules serve nothing, and loading
them puts two copies of libnl in one process: the one NIXL's wheel bundles (its UCX InfiniBand
modules link it) and the system's (Debian's libibverbs, which the Mooncake store client and
UCX's EFA module link). The two copies' destructors crash the process at exit (SIGSEGV in
``rtnl_tc_unregister``). There the modules are kept out with ``UCX_MODULES=^ib``; cma, TCP and
shared memory still carry the transfers. With RDMA devices, or with ``UCX_MODULES`` set by the
operator, nothing is changed.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from pathlib import Path

# Process environment variables that shape transfers and travel to the ranks (besides UCX_*).
TRANSFER_ENV_KEYS = ("THP_MEM_ALLOC_ENABLE",)

_SINGLE_HOST = {"THP_MEM_ALLOC_ENABLE": "1", "UCX_NET_DEVICES": "lo"}

NO_RDMA_MODULES = "^ib"
RDMA_DEVICES = Path("/sys/class/infiniband")


def has_rdma_devices(devices: Path = RDMA_DEVICES) -> bool:
    try:
        return any(devices.iterdir())
    except OSError:
        return False


def configure_ucx(environ: MutableMapping[str, str] = os.environ, devices: Path = RDMA_DEVICES) -> str | None:
    """Set ``UCX_MODULES`` for a machine without RDMA devices (see above); the value now in
    force (``None``: UCX's default)."""
    if "UCX_MODULES" not in environ and not has_rdma_devices(devices):
        environ["UCX_MODULES"] = NO_RDMA_MODULES
    return environ.get("UCX_MODULES")


def single_host_transfer_env(operator_env: Mapping[str, str], single_host: bool) -> dict[str, str]:
    """The environment Tandem adds for the rank processes: the single-host choice above when the
    whole deployment runs on one host (an embedded Ray), nothing for a cluster that may span
    nodes; any key the operator already set is left out, so the operator's value is the one used.
    """
    if not single_host:
        return {}
    return {key: value for key, value in _SINGLE_HOST.items() if key not in operator_env}


@dataclass(frozen=True)
class SelectedTransports:
    """What UCX chose for the endpoints to other processes (not the one to itself), from its
    ``UCX_PROTO_INFO`` tables: ``writes`` for ``ucp_put`` (NIXL's WRITE), ``messages`` for active
    messages (NIXL's notifications), each row ``"<size range> <protocol> <transport/device>"``."""

    scope: str = ""  # "intra-node" or "inter-node"
    writes: tuple[str, ...] = ()
    messages: tuple[str, ...] = ()
    tables: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def as_dict(self) -> dict[str, object]:
        return {"scope": self.scope, "writes": list(self.writes), "messages": list(self.messages)}


_PREFIX = re.compile(r"^\[[^\]]*\] \[[^\]]*\]\s*")
_TITLE = re.compile(r"^\S+ (self|intra-node|inter-node) cfg#\d+$")


def selected_transports(ucx_log: str) -> SelectedTransports:
    """Parse the protocol tables UCX prints with ``UCX_PROTO_INFO=y`` (to ``UCX_LOG_FILE``)."""
    tables: dict[str, list[str]] = {}
    scope, operation, key = "", "", ""
    for raw in ucx_log.splitlines():
        line = _PREFIX.sub("", raw).strip()
        if not line.startswith("|"):
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 1:  # a table's title lines: endpoint, then operation
            title = _TITLE.match(cells[0])
            if title:
                scope, operation, key = title.group(1), "", ""
            elif scope and not operation:
                operation = cells[0]
                key = f"{scope}: {operation}" if scope != "self" else ""
                if key:
                    tables.setdefault(key, [])
        elif key and len(cells) == 3 and cells[0] != "Range":
            row = " ".join(cells)
            if row not in tables[key]:
                tables[key].append(row)

    def rows(scope: str, prefix: str) -> tuple[str, ...]:
        for name, found in tables.items():
            if name.startswith(f"{scope}: {prefix}"):
                return tuple(found)
        return ()

    for peer_scope in ("intra-node", "inter-node"):
        writes = rows(peer_scope, "remote memory write by ucp_put* from host memory")
        writes = writes or rows(peer_scope, "remote memory write by ucp_put*")
        if writes:
            messages = rows(peer_scope, "active message by ucp_am_send* from")
            return SelectedTransports(peer_scope, writes, messages, {k: tuple(v) for k, v in tables.items()})
    return SelectedTransports(tables={k: tuple(v) for k, v in tables.items()})
