"""The shared KV store on Mooncake Store (``mooncake-transfer-engine``; its non-CUDA build on
CPU machines): a master (``mooncake_master``, with its HTTP metadata server) and a client in
every rank that lends the store a memory segment. Blocks are plain values under string keys.

Its listeners: the client's TCP transport and handshake server, which Mooncake binds on every
interface, are kept on ``local_hostname`` by the bind guard (``kvtransfer/bind_guard.py``), which
the rank's process is started with. A client on loopback without the guard is refused; one on a
network address needs ``trusted_network``, as does a client without the guard (it then listens on
every interface).

Return codes: ``put``/``is_exist`` answer a negative code when the call failed (e.g. -600 when
the master is unreachable); ``get`` answers empty bytes for a missing key or a failed call, so
an empty answer after an ``is_exist`` of 1 is a failure.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

from tandem.kvtransfer.bind_guard import bind_wildcards_to, guard_loaded, is_loopback
from tandem.kvtransfer.kv_store import KVStore, StoreConfig, StoreError

log = logging.getLogger(__name__)

TCP_DATA_HOST_ENV = "MC_TCP_BIND_ADDRESS"


def keep_listeners_on(config: StoreConfig) -> None:
    """Put the client's listeners on ``config.local_hostname`` before Mooncake opens them, or
    refuse (``StoreError``) where they would be reachable by more than the operator allowed:
    an address beyond loopback without ``trusted_network``, or (without the bind guard loaded in
    this process) every interface without ``trusted_network``."""
    host = config.local_hostname
    if not is_loopback(host) and not config.trusted_network:
        raise StoreError(
            f"the store client would listen on {host}, reachable from the network, and it serves "
            "reads and writes of this process's memory to whoever connects: set "
            "store.trusted_network: true in the topology only where the network is the deployment's own"
        )
    if guard_loaded():
        bind_wildcards_to(host)
    elif config.trusted_network:
        log.warning("the store client listens on every interface (trusted network, no bind guard)")
    else:
        raise StoreError(
            f"the store client's listeners cannot be kept on {host}: this process was not started "
            "with the bind guard preloaded (kvtransfer/bind_guard.py), and Mooncake would listen on "
            "every interface"
        )


@contextlib.contextmanager
def _tcp_data_host(host: str) -> Iterator[None]:
    """While the client sets up: the address Mooncake advertises for its TCP data transfers,
    read from the environment (else the host's outward one, whatever ``local_hostname`` says,
    and a peer would connect there). Put back afterwards: a value left in this process's
    environment would reach every process it starts, as their address."""
    before = os.environ.get(TCP_DATA_HOST_ENV)
    os.environ[TCP_DATA_HOST_ENV] = host
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(TCP_DATA_HOST_ENV, None)
        else:
            os.environ[TCP_DATA_HOST_ENV] = before


class MooncakeStore(KVStore):
    def __init__(self, config: StoreConfig) -> None:
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as error:  # the package, or a library it loads (libibverbs)
            raise StoreError(f"the Mooncake store client cannot be loaded: {error}") from error
        self.config = config
        keep_listeners_on(config)
        self._store: Any = MooncakeDistributedStore()
        with _tcp_data_host(config.local_hostname):
            code = self._store.setup(
                config.local_hostname,
                config.metadata,
                config.segment_bytes,
                config.local_buffer_bytes,
                config.protocol,
                "",
                config.master,
            )
        if code != 0:
            raise StoreError(f"Mooncake store setup against master {config.master} failed (code {code})")
        self._failed = False

    def exists(self, keys: Sequence[str]) -> list[bool]:
        if not keys:
            return []
        codes = self._store.batch_is_exist(list(keys))
        if len(codes) != len(keys) or any(c < 0 for c in codes):
            self._failed = True
            raise StoreError(f"is_exist failed (codes {sorted(set(codes))})")
        return [c == 1 for c in codes]

    def get(self, key: str) -> bytes | None:
        value = self._store.get(key)
        if value:
            return bytes(value)
        code = self._store.is_exist(key)
        if code < 0:
            self._failed = True
            raise StoreError(f"get of {key} failed (code {code})")
        if code == 1:
            raise StoreError(f"get of {key} came back empty though the key exists")
        return None

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """One batched read; an empty answer is a miss (a key evicted since, or a failed read:
        the caller stops its run there either way)."""
        if not keys:
            return []
        values = self._store.get_batch(list(keys))
        if len(values) != len(keys):
            self._failed = True
            raise StoreError(f"get_batch answered {len(values)} values for {len(keys)} keys")
        return [bytes(v) if v else None for v in values]

    def put(self, key: str, value: bytes) -> None:
        code = self._store.put(key, value)
        self._failed = code != 0
        if code != 0:
            raise StoreError(f"put of {key} ({len(value)} bytes) failed (code {code})")

    def close(self) -> None:
        """Leave the store. With its master unreachable the client's close retries for about
        ten seconds holding the interpreter; it is waited for all the same, since a client
        left to be destroyed during the interpreter's finalization crashes the process."""
        self._store.close()
