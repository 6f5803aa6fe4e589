"""The shared KV store's master, when the deployment runs it: ``mooncake_master`` (from the
``mooncake-transfer-engine`` package) with its HTTP metadata server, started by the controller
and stopped with it (it is the controller's child and dies with it, even on a crash).

It listens on ``host`` alone (loopback by default: one machine; a node address on a cluster,
which takes ``store.trusted_network``) on ports the OS had free: its RPC port, its HTTP metadata
server and its HTTP metrics/admin server. The metadata server binds every interface whatever it
is told, so the master runs with the bind guard (``kvtransfer/bind_guard.py``) preloaded. Its
memory is what the ranks' store clients lend it (``segment_bytes`` each).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import ray

from tandem.cluster.topology import StoreSpec
from tandem.kvtransfer.bind_guard import BindGuardError, guard_library, is_loopback, preload_env
from tandem.kvtransfer.kv_store import StoreConfig

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


class StoreMasterError(RuntimeError):
    """The master could not be started: the message says why."""


def master_binary() -> Path:
    """The ``mooncake_master`` executable the installed package ships."""
    try:
        import mooncake
    except ImportError as error:
        raise StoreMasterError(
            "the KV store needs mooncake-transfer-engine (mooncake-transfer-engine-non-cuda on CPU "
            f"machines): {error}"
        ) from error
    path = Path(mooncake.__file__).parent / "mooncake_master"
    if not path.exists():
        raise StoreMasterError(f"{path} is missing from the installed mooncake package")
    return path


def refuse_untrusted_nodes(spec: StoreSpec) -> None:
    """``StoreMasterError`` when a node of the Ray cluster is reached at an address other than
    loopback and the topology does not say the network is trusted: every rank's store client
    listens on its node's address and serves reads and writes of the rank's memory, unauthenticated."""
    if spec.trusted_network:
        return
    exposed = sorted(
        {str(n["NodeManagerAddress"]) for n in ray.nodes() if n.get("Alive")} - {""},
    )
    exposed = [a for a in exposed if not is_loopback(a)]
    if exposed:
        raise StoreMasterError(
            f"store: the cluster's nodes are reached at {', '.join(exposed)}, where each rank's store "
            "client would listen, serving reads and writes of the rank's memory to whoever connects; "
            "set store.trusted_network: true in the topology if only the deployment's hosts reach it"
        )


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


@dataclass
class StoreMaster:
    host: str
    rpc_port: int
    metadata_port: int
    process: subprocess.Popen[bytes]

    @property
    def master(self) -> str:
        return f"{self.host}:{self.rpc_port}"

    @property
    def metadata(self) -> str:
        return f"http://{self.host}:{self.metadata_port}/metadata"

    @staticmethod
    def start(host: str = "127.0.0.1", log_dir: str | None = None, timeout_s: float = 30.0) -> StoreMaster:
        """Start the master, every listener of it on ``host`` (the bind guard preloaded)."""
        binary = master_binary()
        try:
            guard = preload_env(guard_library(), host)
        except BindGuardError as error:
            raise StoreMasterError(str(error)) from error
        rpc, meta, admin = _free_port(host), _free_port(host), _free_port(host)
        args = [
            str(binary),
            f"-rpc_address={host}",
            f"-rpc_port={rpc}",
            "-enable_http_metadata_server=true",
            f"-http_metadata_server_host={host}",
            f"-http_metadata_server_port={meta}",
            f"-metrics_port={admin}",
            f"-metrics_host={host}",
        ]
        out = open(os.path.join(log_dir, "mooncake_master.log"), "ab") if log_dir else subprocess.DEVNULL  # noqa: SIM115
        process = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            preexec_fn=_die_with_parent,
            env={**os.environ, **guard},
        )
        master = StoreMaster(host, rpc, meta, process)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise StoreMasterError(f"mooncake_master exited with code {process.returncode} at start")
            if all(_listening(host, port) for port in (rpc, meta)):
                log.info("KV store master on %s (metadata %s)", master.master, master.metadata)
                return master
            time.sleep(0.1)
        master.stop()
        raise StoreMasterError(f"mooncake_master did not listen on {host}:{rpc} within {timeout_s:.0f} s")

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def _listening(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def store_setup(
    spec: StoreSpec | None,
) -> tuple[StoreConfig | None, StoreMaster | None, tuple[tuple[str, str], ...]]:
    """The ranks' store client settings, the deployment's own master if the topology names
    none (started now), and what each rank's process starts with; nothing without a store.

    Mooncake's clients and master listen on every interface whatever they are told, so each
    rank starts with the bind guard preloaded and keeps its client's listeners on its node's
    address (``kvtransfer/mooncake_store.py``), as the master keeps its own on ``spec.host``.
    A node whose address is not loopback needs ``trusted_network``."""
    if spec is None:
        return None, None, ()
    refuse_untrusted_nodes(spec)
    rank_env = tuple(preload_env(guard_library()).items())
    segment, trusted = spec.segment_mb << 20, spec.trusted_network
    if spec.master is not None:
        host = spec.master.rsplit(":", 1)[0]
        metadata = spec.metadata or f"http://{host}:8080/metadata"
        config = StoreConfig(spec.master, metadata, segment_bytes=segment, trusted_network=trusted)
        return config, None, rank_env
    master = StoreMaster.start(spec.host)
    config = StoreConfig(master.master, master.metadata, segment_bytes=segment, trusted_network=trusted)
    return config, master, rank_env
