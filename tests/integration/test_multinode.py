"""``tandem serve --address`` on a three-node Ray cluster built the way an operator builds one:
a head, a node labelled prefill and a node labelled decode, each its own raylet. Everything is
driven through the command line and gRPC, as an operator would; this process never joins Ray.

The tests run in order on one deployment: placement by role and the colocated engine's tokens
(KV crossing nodes over NIXL), two frontends against one, the loss and return of the decode
node, then ``tandem stop`` from a new process.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from tandem.client.grpc_client import ClientOptions, status, wait_serving
from tandem.cluster.serve import demo_model_dir
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.wire.request_params import SamplingParams
from tests.integration.ray_nodes import RayNodes

CLI = [sys.executable, "-m", "tandem.cli"]
ROLE = "tandem.io/role"
NAME = "multi"
PAGE = 64  # the local preset's page size


@dataclass
class Deployment:
    nodes: RayNodes
    frontends: list[str]  # host:port of each frontend's gRPC server

    def tandem(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [*CLI, *args], capture_output=True, text=True, timeout=timeout, env=self.nodes.env
        )

    def status(self) -> dict[str, Any]:
        out = self.tandem("status", "--address", self.nodes.address, "--name", NAME)
        assert out.returncode == 0, out.stderr
        return dict(json.loads(out.stdout))

    def generate(
        self, frontend: int, rows: list[dict[str, Any]], concurrency: int = 4
    ) -> list[dict[str, Any]]:
        prompts = self.nodes.root / f"prompts-{frontend}-{time.monotonic_ns()}.jsonl"
        prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
        out = self.tandem(
            "client", "generate", "--prompts-file", str(prompts), "--max-tokens", "4", "--ignore-eos",
            "--concurrency", str(concurrency), "--json", "--addr", self.frontends[frontend],
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        return list(json.loads(out.stdout)["outputs"])


MIGRATION_WAIT_S = 15  # a stream whose decode rank is lost waits this long for another (serve's flag)


def _decode_running(reply: Any) -> int:
    """Requests the decode ranks run, in a ClusterStatus reply."""
    return sum(r.running for g in reply.groups if g.role == "decode" for r in g.ranks)


@pytest.fixture(scope="module")
def deployment() -> Iterator[Deployment]:
    """Started as a Ray job (``ray job submit -- tandem serve --address auto --detach``): the
    job ends once it serves, and the deployment stays."""
    nodes = RayNodes(dashboard=True)
    try:
        nodes.add_node({ROLE: "prefill"})
        nodes.add_node({ROLE: "decode"})
        out = nodes.submit_job(
            *CLI, "serve", "--address", "auto", "--name", NAME, "--detach", "--frontends", "2",
            "--port", "0", "--metrics-port", "0", "--dtype", "float64", "--preset", "local",
            "--migration-wait", str(MIGRATION_WAIT_S),
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        assert "deployment multi, detached" in out.stdout, out.stdout
        dep = Deployment(nodes, [])
        dep.frontends = [f["address"] for f in dep.status()["frontends"]]
        assert len(dep.frontends) == 2
        yield dep
    finally:
        nodes.shutdown()


def _reference(nodes: RayNodes, prompts: list[list[int]]) -> list[list[int]]:
    engine = ColocatedEngine.from_model_dir(demo_model_dir(), torch.float64, EngineConfig())
    sampling = SamplingParams(max_tokens=4, ignore_eos=True)
    return [list(r.token_ids) for r in engine.generate(prompts, [sampling] * len(prompts))]


def test_dry_run_names_each_groups_node(deployment: Deployment) -> None:
    prefill = deployment.nodes.node_with(ROLE, "prefill")
    decode = deployment.nodes.node_with(ROLE, "decode")
    out = deployment.tandem("serve", "--address", deployment.nodes.address, "--name", "other", "--dry-run")
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.strip().startswith("prefill0") and f"rank 1 on {prefill[:12]}" in line for line in lines)
    assert any(line.strip().startswith("decode0") and f"rank 1 on {decode[:12]}" in line for line in lines)
    # a pool that fits nowhere says why, and the command fails
    too_big = deployment.nodes.root / "big.yaml"
    too_big.write_text("name: big\ndecode: {groups: 1, dep: 40}\ncpus_per_rank: 0.05\n")
    out = deployment.tandem(
        "serve", "--address", deployment.nodes.address, "--topology", str(too_big), "--dry-run"
    )
    assert out.returncode == 1
    assert "decode0 (decode, nodes tandem.io/role=decode): cannot be placed: needs 40 bundles" in out.stdout


def test_groups_run_on_their_role_nodes_and_give_the_colocated_tokens(deployment: Deployment) -> None:
    prefill = deployment.nodes.node_with(ROLE, "prefill")
    decode = deployment.nodes.node_with(ROLE, "decode")
    state = deployment.status()
    where = {r["rank"]: r["node_id"] for g in state["groups"] for r in g["ranks"]}
    assert where == {
        "prefill0-r0": prefill,
        "prefill0-r1": prefill,
        "decode0-r0": decode,
        "decode0-r1": decode,
    }
    assert all(r["pid"] > 0 for g in state["groups"] for r in g["ranks"])
    assert state["controller"]["pid"] > 0 and state["controller"]["node_id"]

    rng = random.Random(1)
    prompts = [[rng.randrange(10, 250) for _ in range(n)] for n in (5, 70, 150)]
    expected = _reference(deployment.nodes, prompts)
    for frontend in (0, 1):
        outputs = deployment.generate(frontend, [{"prompt_ids": p} for p in prompts])
        assert [o["token_ids"] for o in outputs] == expected
        # the KV crossed from the prefill node to the decode node
        assert all(o["bill"]["kv_bytes"] > 0 for o in outputs)

    # the same status through gRPC, from each frontend
    reply = asyncio.run(status(ClientOptions(deployment.frontends[1])))
    assert {f.name for f in reply.frontends} == {"tandem-frontend-0", "tandem-frontend-1"}
    assert {r.place.node_labels[ROLE] for g in reply.groups for r in g.ranks} == {"prefill", "decode"}

    # metrics discovery, from either frontend, lists every frontend, the controller and each rank
    for frontend in state["frontends"]:
        with urllib.request.urlopen(f"http://{frontend['metrics']}/sd", timeout=10) as reply_sd:
            document = json.loads(reply_sd.read())
        processes = Counter(t["labels"]["tandem_process"] for t in document)
        assert processes == {"frontend": 2, "controller": 1, "rank": 4}, document
        addresses = {t["targets"][0] for t in document}
        assert {f["metrics"] for f in state["frontends"]} <= addresses


def _conversations(seed: int, n: int) -> tuple[list[list[int]], list[list[int]]]:
    rng = random.Random(seed)
    first = [[rng.randrange(10, 250) for _ in range(3 * PAGE + 8)] for _ in range(n)]
    second = [p + [rng.randrange(10, 250) for _ in range(PAGE + 16)] for p in first]
    return first, second


def _hit_rate(outputs: list[dict[str, Any]]) -> float:
    return sum(o["cached_tokens"] for o in outputs) / sum(o["prompt_tokens"] for o in outputs)


def test_two_frontends_share_the_cache_and_the_load(deployment: Deployment) -> None:
    n = 8
    first, second = _conversations(2, n)
    one = deployment.generate(0, [{"prompt_ids": p} for p in first])
    one += deployment.generate(0, [{"prompt_ids": p} for p in second])

    first, second = _conversations(3, n)
    two: list[dict[str, Any]] = []
    lock = threading.Lock()

    def run(frontend: int, prompts: list[list[int]]) -> None:
        outputs = deployment.generate(frontend, [{"prompt_ids": p} for p in prompts])
        with lock:
            two.extend(outputs)

    # both frontends at once; each conversation's second turn goes to the other frontend
    for turn, cross in ((first, False), (second, True)):
        halves = [turn[: n // 2], turn[n // 2 :]]
        threads = [
            threading.Thread(target=run, args=(f ^ int(cross), half))
            for f, half in zip((0, 1), halves, strict=True)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    hit_one, hit_two = _hit_rate(one), _hit_rate(two)
    per_rank = Counter(o["placement"]["prefill_rank"] for o in two)
    print(
        f"hit rate: one frontend {hit_one:.3f}, two frontends {hit_two:.3f}; prefill ranks {dict(per_rank)}"
    )
    assert hit_one > 0.3  # second turns find their first turn's pages
    assert abs(hit_two - hit_one) <= 0.05
    assert max(per_rank.values()) <= 0.75 * len(two), per_rank


def test_a_frontend_whose_process_dies_comes_back_and_serves(deployment: Deployment) -> None:
    before = {f["name"]: f for f in deployment.status()["frontends"]}
    os.kill(before["tandem-frontend-1"]["pid"], signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:
        after = {f["name"]: f for f in deployment.status()["frontends"]}
        if (
            set(after) == set(before)
            and after["tandem-frontend-1"]["pid"] != before["tandem-frontend-1"]["pid"]
        ):
            break
        assert time.monotonic() < deadline, after
        time.sleep(1)
    address = after["tandem-frontend-1"]["address"]
    assert asyncio.run(wait_serving(ClientOptions(address), 120))
    deployment.frontends = [after[f"tandem-frontend-{i}"]["address"] for i in range(2)]
    rng = random.Random(6)
    prompts = [[rng.randrange(10, 250) for _ in range(30)]]
    outputs = deployment.generate(1, [{"prompt_ids": p} for p in prompts])
    assert [o["token_ids"] for o in outputs] == _reference(deployment.nodes, prompts)


def test_losing_the_decode_node_fails_its_streams_and_the_group_comes_back(deployment: Deployment) -> None:
    nodes = deployment.nodes
    decode = nodes.node_with(ROLE, "decode")
    state = deployment.status()
    # a frontend on a node that stays
    survivor = next(f["address"] for f in state["frontends"] if f["node_id"] != decode)

    prompts = nodes.root / "long.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_ids": [11 + i, 12, 13]}) + "\n" for i in range(2)))
    streams = subprocess.Popen(
        [*CLI, "client", "generate", "--prompts-file", str(prompts), "--max-tokens", "2040",
         "--ignore-eos", "--concurrency", "2", "--json", "--addr", survivor],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=nodes.env,
    )  # fmt: skip
    options = ClientOptions(survivor, timeout_s=10)
    deadline = time.monotonic() + 60
    while _decode_running(asyncio.run(status(options))) < 2:  # the streams run on the decode node
        assert streams.poll() is None and time.monotonic() < deadline, streams.communicate()
        time.sleep(0.5)
    nodes.kill_raylet(decode)
    killed = time.monotonic()
    out, err = streams.communicate(timeout=150)  # they wait --migration-wait for a decode rank first
    ended_s = time.monotonic() - killed
    assert streams.returncode == 0, err
    outputs = json.loads(out)["outputs"]
    assert all(o["finish_reason"] == "error" and "decode0" in o["error"] for o in outputs), outputs
    print(f"streams ended {ended_s:.1f} s after the decode node was lost: {outputs[0]['error']}")
    assert MIGRATION_WAIT_S <= ended_s < MIGRATION_WAIT_S + 60

    # the surviving frontend answers health and status; the group says why it is down
    reply = asyncio.run(status(options))
    down = next(g for g in reply.groups if g.group_id == "decode0")
    assert down.state == "failed", down
    assert asyncio.run(wait_serving(options, 0)) is False  # no decode rank takes work
    # a frontend that ran on the lost node comes back on another and serves again
    deadline = time.monotonic() + 120
    while True:
        frontends = deployment.status()["frontends"]
        if len(frontends) == 2 and all(f["node_id"] != decode for f in frontends):
            break
        assert time.monotonic() < deadline, frontends
        time.sleep(1)
    moved = [f for f in state["frontends"] if f["node_id"] == decode]
    print(f"frontends on the lost node: {[f['name'] for f in moved]}")
    deployment.frontends = [f["address"] for f in frontends]
    for f in frontends:
        assert asyncio.run(status(ClientOptions(f["address"], timeout_s=10))).deployment == NAME

    # no node of its role is left: the rebuild cannot be placed, and the status says so
    deadline = time.monotonic() + 60
    while "not placed" not in str(_group(deployment.status(), "decode0")["failure"]):
        assert time.monotonic() < deadline, _group(deployment.status(), "decode0")
        time.sleep(1)
    print(f"while the node is lost: {_group(deployment.status(), 'decode0')['failure']}")
    assert _controller_metric(deployment, 'tandem_group_unplaceable{group="decode0"') == 1.0
    assert _group(deployment.status(), "decode0")["unplaceable"] is True
    grpc_view = asyncio.run(status(ClientOptions(survivor, timeout_s=10)))
    assert next(g for g in grpc_view.groups if g.group_id == "decode0").unplaceable

    nodes.add_node({ROLE: "decode"})  # the node comes back (a new raylet, same label)
    assert asyncio.run(wait_serving(options, 180)), deployment.status()
    back = deployment.status()
    (new_decode,) = set(nodes.nodes_with(ROLE, "decode")) - {decode}
    assert _group(back, "decode0")["incarnation"] == 2  # one rebuild, however many tries found no room
    assert {r["node_id"] for g in back["groups"] if g["role"] == "decode" for r in g["ranks"]} == {new_decode}
    rng = random.Random(4)
    again = [[rng.randrange(10, 250) for _ in range(40)]]
    expected = _reference(nodes, again)
    for index in range(len(deployment.frontends)):  # through every frontend, moved ones too
        outputs = deployment.generate(index, [{"prompt_ids": p} for p in again])
        assert [o["token_ids"] for o in outputs] == expected


def test_a_second_deployment_of_the_name_is_refused_and_stop_leaves_nothing(deployment: Deployment) -> None:
    nodes = deployment.nodes
    again = deployment.tandem("serve", "--address", nodes.address, "--name", NAME, "--detach", timeout=120)
    assert again.returncode == 2
    assert "--name: a deployment named 'multi' already runs on this Ray cluster" in again.stderr

    stopped = deployment.tandem("stop", "--address", nodes.address, "--name", NAME)
    assert stopped.returncode == 0, stopped.stderr
    assert "no placement group left" in stopped.stdout
    left = _leftovers(nodes)
    assert left == {"actors": [], "placement_groups": []}, left
    missing = deployment.tandem("status", "--address", nodes.address, "--name", NAME)
    assert missing.returncode == 2 and "no deployment named 'multi'" in missing.stderr


def _controller_metric(deployment: Deployment, prefix: str) -> float:
    """A series of the controller's /metrics, found through a frontend's discovery document."""
    frontend = deployment.status()["frontends"][0]["metrics"]
    with urllib.request.urlopen(f"http://{frontend}/sd", timeout=10) as reply:
        targets = json.loads(reply.read())
    controller = next(t["targets"][0] for t in targets if t["labels"]["tandem_process"] == "controller")
    with urllib.request.urlopen(f"http://{controller}/metrics", timeout=10) as reply:
        lines = reply.read().decode().splitlines()
    (line,) = [line for line in lines if line.startswith(prefix)]
    return float(line.rsplit(" ", 1)[1])


def _group(state: dict[str, Any], group_id: str) -> dict[str, Any]:
    return next(g for g in state["groups"] if g["group"] == group_id)


def _leftovers(nodes: RayNodes) -> dict[str, list[str]]:
    """Live actors and placement groups of the cluster, read from Ray's GCS by a new process."""
    code = f"""
import json, time, ray
from ray._private import state
from ray.util.placement_group import placement_group_table
ray.init(address={nodes.address!r}, logging_level="ERROR")
deadline = time.monotonic() + 60
while True:
    actors = [a["ActorClassName"] for a in state.actors().values() if a["State"] != "DEAD"]
    pgs = [p["name"] for p in placement_group_table().values() if p["state"] != "REMOVED"]
    if (not actors and not pgs) or time.monotonic() > deadline:
        break
    time.sleep(0.5)
print(json.dumps({{"actors": actors, "placement_groups": pgs}}))
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=nodes.env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def test_a_dep_group_too_big_for_one_node_spans_nodes(deployment: Deployment) -> None:
    """A DEP4 prefill group on prefill nodes that hold two ranks each: its ranks span two nodes,
    join one torch.distributed group across them and give the colocated engine's tokens."""
    nodes = deployment.nodes
    nodes.add_node({ROLE: "prefill"})  # a second prefill node, of one CPU like the first
    topology = nodes.root / "span.yaml"
    topology.write_text(
        "name: span\nprefill: {groups: 1, dep: 4}\ndecode: {groups: 1, dep: 1}\ncpus_per_rank: 0.5\n"
    )
    out = deployment.tandem(
        "serve", "--address", nodes.address, "--name", "span", "--topology", str(topology), "--detach",
        "--port", "0", "--dtype", "float64", timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    try:
        state = json.loads(deployment.tandem("status", "--address", nodes.address, "--name", "span").stdout)
        prefill_nodes = set(nodes.nodes_with(ROLE, "prefill"))
        ranks = _group(state, "prefill0")["ranks"]
        assert len(ranks) == 4 and {r["node_id"] for r in ranks} == prefill_nodes and len(prefill_nodes) == 2
        address = state["frontends"][0]["address"]
        rng = random.Random(5)
        prompts = [[rng.randrange(10, 250) for _ in range(n)] for n in (9, 70, 130, 20)]
        span = Deployment(nodes, [address])
        outputs = span.generate(0, [{"prompt_ids": p} for p in prompts])
        assert [o["token_ids"] for o in outputs] == _reference(nodes, prompts)
        assert len({o["placement"]["prefill_rank"] for o in outputs}) > 1
    finally:
        stopped = deployment.tandem("stop", "--address", nodes.address, "--name", "span")
        assert stopped.returncode == 0, stopped.stderr
