"""The bind guard: preloaded into a process, it puts that process's wildcard binds on the address
in TANDEM_BIND_HOST and leaves every other bind alone; a store client refuses to open where its
listeners would reach further than the operator allowed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tandem.kvtransfer.bind_guard import guard_library, guard_loaded, is_loopback, preload_env
from tandem.kvtransfer.kv_store import StoreConfig, StoreError
from tandem.kvtransfer.mooncake_store import MooncakeStore

PROBE = """
import json, socket
from tandem.kvtransfer.bind_guard import guard_loaded
out = {"loaded": guard_loaded()}
for name, family, address in (
    ("v4 wildcard", socket.AF_INET, "0.0.0.0"),
    ("v6 wildcard", socket.AF_INET6, "::"),
    ("v4 explicit", socket.AF_INET, "127.0.0.2"),
):
    with socket.socket(family) as s:
        if family == socket.AF_INET6:
            s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # dual-stack, as Mooncake's
        s.bind((address, 0))
        s.listen()
        out[name] = s.getsockname()[0]
print(json.dumps(out))
"""


def _probe(env: dict[str, str]) -> dict[str, object]:
    base = {k: v for k, v in os.environ.items() if k not in ("LD_PRELOAD", "TANDEM_BIND_HOST")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=base | env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return dict(json.loads(done.stdout))


def test_wildcard_binds_go_to_the_bind_host_and_explicit_ones_are_left_alone() -> None:
    library = guard_library()
    assert guard_library() == library  # built once, cached by its source's hash

    assert _probe(preload_env(library, "127.0.0.1")) == {
        "loaded": True,
        "v4 wildcard": "127.0.0.1",
        "v6 wildcard": "::ffff:127.0.0.1",
        "v4 explicit": "127.0.0.2",
    }
    # loaded but with no host: every bind is the process's own
    assert _probe(preload_env(library)) == {
        "loaded": True,
        "v4 wildcard": "0.0.0.0",
        "v6 wildcard": "::",
        "v4 explicit": "127.0.0.2",
    }
    assert _probe({})["loaded"] is False


def test_a_store_client_refuses_listeners_it_cannot_keep() -> None:
    assert not guard_loaded()  # the test process was started without it
    with pytest.raises(StoreError, match="not started with the bind guard preloaded"):
        MooncakeStore(StoreConfig("127.0.0.1:1", "http://127.0.0.1:1/metadata"))
    with pytest.raises(StoreError, match=r"store\.trusted_network: true"):
        MooncakeStore(StoreConfig("10.0.0.1:1", "http://10.0.0.1:1/metadata", local_hostname="10.0.0.2"))


def test_loopback_addresses() -> None:
    assert is_loopback("127.0.0.1") and is_loopback("127.0.1.2") and is_loopback("::1")
    assert is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("10.0.0.1")
    assert not is_loopback("node-a.example")
