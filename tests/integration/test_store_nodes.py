"""The shared KV store across nodes, and what listens where on a cluster (``tandem serve
--address``). Three nodes of one Ray cluster, each with an address of its own in the loopback
range as separate hosts have (the head 127.0.1.1 with the controller, the frontend and the
store's master; prefill ranks on 127.0.1.2; decode ranks on 127.0.1.3):

- a rank's store client advertises its node's address and listens there alone, so a block the
  decode node wrote is read by a prefill rank on the other node (a store hit in the bill, with
  the tokens of the colocated engine); advertised at 127.0.0.1 it would be a miss;
- every listener of a Tandem process is on its node's address or on loopback (the frontend's
  and the master's, whose host is 127.0.0.1 by default; UCX's, on the devices UCX_NET_DEVICES
  names), none on every interface but each Ray worker's own gRPC server.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from tandem.cluster.serve import demo_model_dir
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.wire.request_params import SamplingParams
from tests.integration.ray_nodes import RayNodes
from tests.listening import listeners

CLI = [sys.executable, "-m", "tandem.cli"]
ROLE = "tandem.io/role"
NAME = "stored"
PAGE = 64
TOKENS = 6


@pytest.fixture(scope="module")
def nodes() -> Iterator[RayNodes]:
    cluster = RayNodes(own_addresses=True)
    # UCX's TCP listens on each network device it uses: the operator's choice (UCX_NET_DEVICES);
    # these "hosts" share one machine's loopback device
    cluster.env["UCX_NET_DEVICES"] = "lo"
    try:
        cluster.add_node({ROLE: "prefill"})
        cluster.add_node({ROLE: "decode"})
        out = subprocess.run(
            [
                *CLI, "serve", "--address", cluster.address, "--name", NAME, "--detach", "--port", "0",
                "--dtype", "float64", "--preset", "local", "--kv-store", "auto",
            ],
            capture_output=True, text=True, timeout=600, env=cluster.env,
        )  # fmt: skip
        assert out.returncode == 0, out.stdout + out.stderr
        yield cluster
    finally:
        cluster.shutdown()


def _tandem(nodes: RayNodes, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=300, env=nodes.env)


def _generate(nodes: RayNodes, frontend: str, prompts: list[list[int]]) -> list[dict[str, Any]]:
    rows = nodes.root / f"prompts-{len(prompts[0])}.jsonl"
    rows.write_text("".join(json.dumps({"prompt_ids": p}) + "\n" for p in prompts))
    out = _tandem(
        nodes, "client", "generate", "--prompts-file", str(rows), "--max-tokens", str(TOKENS),
        "--ignore-eos", "--json", "--addr", frontend,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return list(json.loads(out.stdout)["outputs"])


def test_a_block_written_on_one_node_is_read_by_a_rank_on_another(nodes: RayNodes) -> None:
    state = json.loads(_tandem(nodes, "status", "--address", nodes.address, "--name", NAME).stdout)
    (frontend,) = [f["address"] for f in state["frontends"]]
    rng = random.Random(4)
    engine = ColocatedEngine.from_model_dir(demo_model_dir(), torch.float64, EngineConfig())
    sampling = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    # a conversation's second turn: the prompt, the answer (its KV written to the store by the
    # decode rank, on the decode node) and more; the prefill rank, on the prefill node, reads the
    # answer's page from the store. The decode rank writes back off its loop, and a fetch slower
    # than recomputing is a miss (the rank then holds the page itself): up to three conversations
    for _ in range(3):
        first = [[rng.randrange(10, 250) for _ in range(3 * PAGE - 2)]]  # its third page: the answer's
        answers = _generate(nodes, frontend, first)
        time.sleep(1.0)
        second = [first[0] + answers[0]["token_ids"] + [rng.randrange(10, 250) for _ in range(PAGE)]]
        (turn,) = _generate(nodes, frontend, second)
        expected = [list(r.token_ids) for r in engine.generate(first + second, [sampling] * 2)]
        assert [answers[0]["token_ids"], turn["token_ids"]] == expected
        if turn["bill"]["cached_tokens_by_tier"]["store"] >= PAGE:
            break
    assert turn["bill"]["cached_tokens_by_tier"]["store"] >= PAGE, turn["bill"]


def _ray_worker_servers(nodes: RayNodes) -> set[tuple[int, int]]:
    """(pid, port) of each actor's own gRPC server, from Ray's actor table."""
    code = (
        f"import json, ray; ray.init(address={nodes.address!r}, logging_level='ERROR');"
        "from ray._private import state;"
        "print(json.dumps([[a['Pid'], a['Address']['Port']] for a in state.actors().values()]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=nodes.env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return {(pid, port) for pid, port in json.loads(out.stdout.strip().splitlines()[-1])}


def test_every_tandem_listener_is_on_its_nodes_address_or_loopback(nodes: RayNodes) -> None:
    by_node = {str(n["id"]): str(n["address"]) for n in nodes.nodes()}
    state = json.loads(_tandem(nodes, "status", "--address", nodes.address, "--name", NAME).stdout)
    rank_node = {r["pid"]: by_node[r["node_id"]] for g in state["groups"] for r in g["ranks"]}
    assert sorted(set(rank_node.values())) == ["127.0.1.2", "127.0.1.3"]

    found = listeners(set(nodes.processes()))
    ray_servers = _ray_worker_servers(nodes)
    tandem = [
        x
        for x in found
        if any(k in x.process for k in ("RankActor", "Controller", "Frontend", "mooncake"))
        and (x.pid, x.port) not in ray_servers  # each Ray worker's own gRPC server: every interface
    ]
    for x in tandem:
        assert x.loopback, f"{x} listens beyond loopback"
    for pid, address in rank_node.items():
        mine = [x for x in tandem if x.pid == pid]
        # the channel, the store client's transport and handshake server, the rendezvous (rank 0)
        # and gloo on the node's address; UCX on its device's (lo here)
        on_node = [x for x in mine if x.address.removeprefix("::ffff:") == address]
        assert len(on_node) >= 3, mine
