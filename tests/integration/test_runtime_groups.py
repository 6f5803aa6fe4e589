"""Groups added and removed while the cluster serves: a new group takes work from the next view
on; a removed one is drained first (its decode ranks refuse new requests, which the frontend
routes elsewhere; its prefill ranks get no new jobs), so every request, even one running on the
group being removed, ends with the reference tokens, and every page is free at the end."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import ray
import torch
from ray.util.placement_group import placement_group, remove_placement_group

from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import PoolSpec, Topology
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.frontend.running import GenerateSpec
from tandem.wire.request_params import SamplingParams
from tandem.wire.stream_summary import StreamSummary

PAGE = 16


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[Server]:
    pool = PoolSpec(dep=2, page_size=PAGE, num_pages=64)
    topology = Topology.preset("local").model_copy(update={"prefill": pool, "decode": pool})
    served = Server(ServeOptions(topology, tiny_dir, port=0, dtype="float64"))
    try:
        served.start()
        yield served
    finally:
        served.stop()
        ray.shutdown()


def _workload(seed: int, n: int, max_tokens: int) -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(256) for _ in range(rng.randrange(20, 60))] for _ in range(n)]
    return prompts, [SamplingParams(max_tokens=max_tokens, ignore_eos=True)] * n


def _expected(tiny: Path, prompts: list[list[int]], sampling: list[SamplingParams]) -> list[list[int]]:
    engine = ColocatedEngine.from_model_dir(tiny, torch.float64, EngineConfig(page_size=PAGE, num_pages=512))
    return [o.token_ids for o in engine.generate(prompts, sampling)]


def _groups(server: Server) -> dict[str, tuple[str, int]]:
    view = ray.get(server.controller.routing_view.remote())
    return {g.group_id: (g.state, len(g.ranks)) for g in view.groups}


def _frontend_refreshed(server: Server) -> None:
    """The frontend reads the controller's view every 0.2 s: a second is five refreshes."""
    time.sleep(1.0)


def _generate_during(server: Server, prompts: list[list[int]], sampling: list[SamplingParams],
                     action: object) -> list[StreamSummary]:  # fmt: skip
    """Run the requests while ``action()`` runs in this thread: half of them under way before it
    starts, the rest sent one by one while it runs (some routed on a view from before it)."""
    half = len(prompts) // 2
    out: list[list[StreamSummary]] = [[] for _ in prompts]

    def send(i: int) -> None:
        spec = GenerateSpec(f"during-{i}", prompts[i], sampling[i])
        out[i] = ray.get(server.frontend.generate.remote([spec]), timeout=300)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for thread in threads[:half]:
        thread.start()
    time.sleep(1.0)  # the first half is on its ranks

    def trickle() -> None:
        for thread in threads[half:]:
            thread.start()
            time.sleep(0.05)

    trickler = threading.Thread(target=trickle)
    trickler.start()
    action()  # type: ignore[operator]
    trickler.join()
    for thread in threads:
        thread.join(timeout=300)
        assert not thread.is_alive()
    return [summaries[0] for summaries in out]


def test_a_decode_group_added_then_the_first_removed_under_load(server: Server, tiny_dir: Path) -> None:
    added = ray.get(server.controller.add_group.remote("decode"))
    assert added == "decode1" and _groups(server)["decode1"] == ("ready", 2)
    _frontend_refreshed(server)
    prompts, sampling = _workload(1, 12, 40)
    summaries = _generate_during(
        server, prompts, sampling, lambda: ray.get(server.controller.remove_group.remote("decode0"))
    )
    assert [s.error for s in summaries] == [None] * len(prompts)
    assert [s.token_ids for s in summaries] == _expected(tiny_dir, prompts, sampling)
    used = {s.decode_rank.group_id for s in summaries[:6] if s.decode_rank is not None}
    assert used == {"decode0", "decode1"}  # the removed group finished what it held
    assert "decode0" not in _groups(server)
    # after the removal, every request goes to the group that is left
    after = server.generate(*_workload(2, 4, 6))
    assert {s.decode_rank.group_id for s in after if s.decode_rank is not None} == {"decode1"}


def test_a_prefill_group_added_then_the_first_removed_under_load(server: Server, tiny_dir: Path) -> None:
    """While the new group starts, the controller answers (the start holds no lock), shows it
    starting, and routes nothing to it; it cannot be removed until it serves. The start is held
    at its placement (a placement group takes every free CPU) until those are checked."""
    held = placement_group([{"CPU": ray.available_resources()["CPU"]}])
    ray.get(held.ready(), timeout=30)
    try:
        adding = server.controller.add_group.remote("prefill")
        deadline = time.monotonic() + 30
        while True:
            status = ray.get(server.controller.status.remote(), timeout=10)  # not behind the start
            if "prefill1" in status or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert status["prefill1"].startswith("starting"), status
        with pytest.raises(ray.exceptions.RayTaskError, match="prefill1 is still starting"):
            ray.get(server.controller.remove_group.remote("prefill1"), timeout=10)
        view = ray.get(server.controller.routing_view.remote())
        assert all(r.group_id != "prefill1" for r in view.prefill)
        assert not ray.wait([adding], timeout=0)[0]  # still held when all of it was checked
    finally:
        remove_placement_group(held)
    added = ray.get(adding)
    assert added == "prefill1" and _groups(server)["prefill1"] == ("ready", 2)
    # before any request reached it, its ranks and the decode ranks have connected their
    # transports (the membership change did it): its first transfer pays no wire-up
    deadline = time.monotonic() + 10
    while True:
        stats = {s.rank.name: s for s in ray.get(server.controller.stats.remote())}
        new = [s for s in stats.values() if s.rank.group_id == "prefill1"]
        decode = [s for s in stats.values() if s.rank.group_id.startswith("decode")]
        connected = [s.peers_connected for s in new] == [len(decode)] * 2
        if (connected and all(s.peers_connected == 4 for s in decode)) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert [s.peers_connected for s in new] == [len(decode)] * 2
    assert [s.peers_connected for s in decode] == [4] * len(decode)  # prefill0's ranks and prefill1's
    assert all(s.kv_bytes_sent == 0 for s in new)  # no transfer yet: connected ahead of one
    _frontend_refreshed(server)
    prompts, sampling = _workload(3, 12, 30)
    summaries = _generate_during(
        server, prompts, sampling, lambda: ray.get(server.controller.remove_group.remote("prefill0"))
    )
    assert [s.error for s in summaries] == [None] * len(prompts)
    assert [s.token_ids for s in summaries] == _expected(tiny_dir, prompts, sampling)
    assert "prefill0" not in _groups(server)
    after = server.generate(*_workload(4, 4, 6))
    assert {s.prefill_rank.group_id for s in after if s.prefill_rank is not None} == {"prefill1"}


def test_the_last_group_of_a_pool_is_not_removed_and_every_page_is_free(server: Server) -> None:
    with pytest.raises(ray.exceptions.RayTaskError, match="last group of its pool"):
        ray.get(server.controller.remove_group.remote("decode1"))
    with pytest.raises(ray.exceptions.RayTaskError, match="expected prefill or decode"):
        ray.get(server.controller.add_group.remote("colocated"))
    ray.get(server.controller.check_integrity.remote())
    deadline = time.monotonic() + 30
    while True:
        stats = ray.get(server.controller.stats.remote())
        if all(s.free_pages == s.total_pages for s in stats) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert {s.rank.group_id for s in stats} == {"prefill1", "decode1"}
    assert all(s.free_pages == s.total_pages for s in stats), stats
