"""A multi-node Ray cluster on this machine, started the way an operator starts one: ``ray start
--head`` and one ``ray start --address ... --labels ...`` per worker node, each its own raylet.

Every process of it runs with token authentication (a token file of its own), so tearing it
down kills exactly its processes (those with that token path in their environment, and every
process they started: Ray starts its agents with an environment of their own), and a node is
lost by killing its raylet (found by its node id). Each node's agents get ports of their own,
as several nodes share this machine.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAY = str(Path(sys.executable).parent / "ray")


class RayNodes:
    def __init__(self, head_cpus: int = 2, dashboard: bool = False, own_addresses: bool = False) -> None:
        """``dashboard``: run the head's dashboard, whose job server takes ``ray job submit``
        (``dashboard_url``). ``own_addresses``: each node has an address of its own in the
        loopback range (the head 127.0.1.1, the next node 127.0.1.2, ...), as the hosts of a real
        cluster do: a process that listens on its node's address alone is reached there only."""
        self._own_addresses = own_addresses
        self._hosts = 0  # nodes given an address of their own
        # a short path: Ray's unix sockets live under it
        self.root = Path(tempfile.mkdtemp(prefix="tn", dir="/tmp"))
        (self.root / "token").write_text(secrets.token_hex(32))
        self.env = os.environ | {
            "RAY_AUTH_MODE": "token",
            "RAY_AUTH_TOKEN_PATH": str(self.root / "token"),
            "RAY_USAGE_STATS_ENABLED": "0",
            "TANDEM_CACHE_DIR": str(self.root / "cache"),
        }
        self.env.pop("RAY_ADDRESS", None)
        port, dashboard_port, *agents = _free_ports(6)  # held together: six different ports
        head = self._node_address()
        self.address = f"{head[0] if head else '127.0.0.1'}:{port}"
        self.dashboard_url = f"http://127.0.0.1:{dashboard_port}" if dashboard else None
        self._ray(
            "start", "--head", f"--port={port}", f"--num-cpus={head_cpus}",
            f"--include-dashboard={dashboard}", f"--dashboard-port={dashboard_port}",
            f"--temp-dir={self.root / 'ray'}",
            "--object-store-memory=150000000", "--disable-usage-stats", *_agent_ports(agents),
            *(f"--node-ip-address={h}" for h in head),
        )  # fmt: skip

    def _node_address(self) -> list[str]:
        """The next node's own address (none without ``own_addresses``)."""
        if not self._own_addresses:
            return []
        self._hosts += 1
        return [f"127.0.1.{self._hosts}"]

    def _ray(self, *args: str) -> str:
        out = subprocess.run([RAY, *args], capture_output=True, text=True, env=self.env, timeout=120)
        if out.returncode != 0:
            raise RuntimeError(f"ray {' '.join(args)} failed: {out.stdout}\n{out.stderr}")
        return out.stdout

    def submit_job(self, *entrypoint: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
        """``ray job submit`` to the head's job server, waiting for it: just after ``ray start``
        it answers "No available agent" until the head's dashboard agent is up."""
        deadline = time.monotonic() + timeout_s
        while True:
            out = subprocess.run(
                [RAY, "job", "submit", "--address", str(self.dashboard_url), "--", *entrypoint],
                capture_output=True, text=True, env=self.env, timeout=timeout_s,
            )  # fmt: skip
            if "No available agent" not in out.stderr + out.stdout or time.monotonic() > deadline:
                return out
            time.sleep(2)

    def add_node(self, labels: dict[str, str], cpus: int = 1) -> None:
        label = ",".join(f"{k}={v}" for k, v in labels.items())
        self._ray(
            "start", f"--address={self.address}", f"--num-cpus={cpus}", f"--labels={label}",
            "--object-store-memory=150000000", "--disable-usage-stats", *_agent_ports(_free_ports(4)),
            *(f"--node-ip-address={h}" for h in self._node_address()),
        )  # fmt: skip

    def nodes(self) -> list[dict[str, object]]:
        """Live nodes: id and labels, read by a process of its own (this one stays off Ray)."""
        code = (
            f"import json, ray; ray.init(address={self.address!r}, logging_level='ERROR');"
            "print(json.dumps([{'id': n['NodeID'], 'labels': n['Labels'], 'alive': n['Alive'],"
            " 'address': n['NodeManagerAddress']}"
            " for n in ray.nodes()]))"
        )
        out = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, env=self.env, timeout=120
        )
        assert out.returncode == 0, out.stderr
        import json

        return [n for n in json.loads(out.stdout.strip().splitlines()[-1]) if n["alive"]]

    def nodes_with(self, key: str, value: str) -> list[str]:
        """Ids of the live nodes labelled ``key=value`` (a lost node stays listed until Ray's
        health checks mark it dead)."""
        return [str(n["id"]) for n in self.nodes() if dict(n["labels"]).get(key) == value]  # type: ignore[call-overload]

    def node_with(self, key: str, value: str) -> str:
        ids = self.nodes_with(key, value)
        assert len(ids) == 1, ids
        return ids[0]

    def kill_raylet(self, node_id: str) -> None:
        """Lose a node: SIGKILL its raylet (its workers follow)."""
        pids = self._pids(f"--node_id={node_id}", "raylet")
        assert pids, f"no raylet of node {node_id}"
        for pid in pids:
            os.kill(pid, signal.SIGKILL)

    def _pids(self, *needles: str, file: str = "cmdline") -> list[int]:
        """Processes whose command line (or environment) holds every needle."""
        out = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            try:
                text = (proc / file).read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if all(n in text for n in needles):
                out.append(int(proc.name))
        return out

    def processes(self) -> list[int]:
        """Every live process of this cluster: those carrying its token path in their
        environment (Ray's, and the workers it started) and all their descendants."""
        mine = set(self._pids(f"RAY_AUTH_TOKEN_PATH={self.root / 'token'}", file="environ"))
        children: dict[int, list[int]] = {}
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                ppid = int((proc / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(proc.name))
        todo = list(mine)
        while todo:
            for child in children.get(todo.pop(), []):
                if child not in mine and child != os.getpid():
                    mine.add(child)
                    todo.append(child)
        return sorted(mine)

    def shutdown(self) -> None:
        """Kill every process of this cluster, then remove its files."""
        for _ in range(5):
            pids = self.processes()
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.5)
        shutil.rmtree(self.root, ignore_errors=True)


def _agent_ports(ports: list[int]) -> list[str]:
    listen, grpc, runtime_env, metrics = ports
    return [
        f"--dashboard-agent-listen-port={listen}",
        f"--dashboard-agent-grpc-port={grpc}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--metrics-export-port={metrics}",
    ]


def _free_ports(count: int) -> list[int]:
    """``count`` different free ports: each socket stays bound until all are picked (one picked
    and released at a time, the OS may hand the same port out twice, and Ray then refuses)."""
    import socket

    with contextlib.ExitStack() as stack:
        sockets = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [int(s.getsockname()[1]) for s in sockets]
