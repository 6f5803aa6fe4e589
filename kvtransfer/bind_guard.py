"""Keeping a library's listeners on one address when it binds every interface.

Mooncake's store client listens on every interface whatever it is told: its TCP transport binds
``[::]`` (dual-stack) and serves, to whoever connects, reads and writes of any address of the
process that a 17-byte header names, with no authentication; its handshake server binds
``0.0.0.0``; and ``mooncake_master``'s HTTP metadata server binds ``0.0.0.0`` though given a host.
Tandem cannot change Mooncake, so it does not let it choose: a process that runs it (a rank with
a store, the deployment's master) starts with this guard preloaded (``LD_PRELOAD``), a small
library whose ``bind`` puts a wildcard bind (``0.0.0.0``, ``::``) on the address in
``TANDEM_BIND_HOST`` while that variable is set, and passes every other bind through::

    bind(fd, 0.0.0.0:p)  ->  bind(fd, HOST:p)
    bind(fd, [::]:p)     ->  bind(fd, [::ffff:HOST]:p)   (an IPv4 HOST on a dual-stack socket)
    bind(fd, 10.0.0.5:p) ->  unchanged

The library is built from ``bind_guard.c`` with the machine's C compiler on first use and cached
by its source's hash (``$XDG_CACHE_HOME/tandem``, else ``~/.cache/tandem``). This module is
torch-free and Ray-free.
"""

from __future__ import annotations

import ctypes
import hashlib
import ipaddress
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

BIND_HOST_ENV = "TANDEM_BIND_HOST"
_SOURCE = Path(__file__).with_name("bind_guard.c")
_MARKER = "tandem_bind_guard_version"


class BindGuardError(RuntimeError):
    """The guard cannot be built or is not loaded where it is needed; the message says what to do."""


def is_loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``); a name, or ``""`` (every
    interface), is not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "tandem"


def guard_library() -> Path:
    """The guard's shared library, built on first use (atomically: a half-written library is
    never at the path)."""
    source = _SOURCE.read_bytes()
    target = _cache_dir() / f"bind-guard-{hashlib.sha256(source).hexdigest()[:16]}.so"
    if target.exists():
        return target
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        raise BindGuardError(
            "the KV store's bind guard needs a C compiler to be built (apt-get install gcc), or set CC to one"
        )
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(prefix=".bind-guard-", suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        done = subprocess.run(
            [compiler, "-shared", "-fPIC", "-O2", "-o", partial, str(_SOURCE), "-ldl"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        if done.returncode != 0:
            raise BindGuardError(f"building {_SOURCE.name} with {compiler} failed: {done.stderr.strip()}")
        os.replace(partial, target)
    finally:
        if os.path.exists(partial):
            os.unlink(partial)
    return target


def preload_env(library: Path, host: str | None = None) -> dict[str, str]:
    """Environment variables that start a process with the guard loaded (before any library the
    process already preloads), binding its wildcard listeners to ``host`` when given."""
    preload = " ".join(p for p in (str(library), os.environ.get("LD_PRELOAD", "")) if p)
    env = {"LD_PRELOAD": preload}
    if host is not None:
        env[BIND_HOST_ENV] = host
    return env


def guard_loaded() -> bool:
    """Whether this process was started with the guard preloaded."""
    try:
        ctypes.c_int.in_dll(ctypes.CDLL(None), _MARKER)
    except ValueError:
        return False
    return True


def bind_wildcards_to(host: str) -> None:
    """From now on, this process's wildcard binds go to ``host``; ``BindGuardError`` when the
    guard is not loaded (the binds would go to every interface)."""
    if not guard_loaded():
        raise BindGuardError(
            f"this process was not started with the bind guard preloaded, so its listeners "
            f"cannot be kept on {host}"
        )
    os.environ[BIND_HOST_ENV] = host
