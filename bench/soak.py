"""A soak run: many requests through a served deployment's gRPC port, some cancelled, then a look
at what is left behind.

Requests draw their prompt and sampling from a pool of ``distinct`` random entries (lengths and
output lengths random; greedy and seeded alike), so repeated prompts meet the prefix cache and
each entry's reference tokens are computed once, by the colocated engine. A fraction of the
requests is cancelled by the client at a random point: before the first token or after some
tokens. At most ``concurrency`` run at once.

At the end every request must have either completed with its reference tokens or been
cancelled (the tokens it got before being a prefix of the reference); every rank's pages must
be free and its page accounting must hold. Meanwhile the resident memory of every process of
the deployment (controller, frontends, ranks; read from ``/proc``, so the deployment runs on
this machine) is sampled: its growth over the second half of the run is reported, and a process
that grew by more than ``rss_slack_mib`` there fails the run.

``tandem bench soak --requests N --concurrency C`` prints the figures as JSON; exit 1 on any
failed check.
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import ray

from tandem.client.grpc_client import ClientOptions, channel, request_message
from tandem.client.prompts import PromptSpec
from tandem.cluster.serve import ServeOptions, Server
from tandem.cluster.topology import Topology
from tandem.engine.colocated import ColocatedEngine
from tandem.engine.engine_config import EngineConfig
from tandem.model.dtypes import DTYPES
from tandem.model.make_tiny import make_tiny_checkpoint
from tandem.protos import tandem_pb2_grpc
from tandem.wire.messages import RankStats
from tandem.wire.request_params import SamplingParams
from tandem.wire.routing_view import RoutingView


@dataclass(frozen=True)
class SoakConfig:
    requests: int = 1000
    concurrency: int = 16
    cancel_fraction: float = 0.05
    distinct: int = 64  # prompts in the pool the requests draw from
    max_prompt_tokens: int = 96
    max_output_tokens: int = 24
    seed: int = 0
    preset: str = "local"
    dtype: str = "float64"  # exact: the references must equal the served tokens bit for bit
    rss_interval_s: float = 0.5
    rss_slack_mib: float = 32.0  # growth over the second half that still counts as flat


@dataclass
class _Counts:
    completed: int = 0
    cancelled: int = 0
    wrong: int = 0
    first_wrong: str | None = None

    def fail(self, why: str) -> None:
        self.wrong += 1
        self.first_wrong = self.first_wrong or why


def _pool(config: SoakConfig, vocab: int) -> list[PromptSpec]:
    rng = random.Random(config.seed)
    pool = []
    for i in range(config.distinct):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(1, config.max_prompt_tokens + 1))]
        sampling = SamplingParams(
            max_tokens=rng.randrange(1, config.max_output_tokens + 1),
            ignore_eos=True,
            temperature=0.8 if i % 2 else 0.0,
            seed=i,
        )
        pool.append(PromptSpec(None, prompt, sampling))
    return pool


def _rss_mib(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        return None
    return None


def _pids(view: RoutingView) -> dict[str, int]:
    """Every process of the deployment by a readable name."""
    out = {f"frontend {f.name}": f.place.pid for f in view.frontends}
    if view.controller is not None:
        out["controller"] = view.controller.pid
    for group in view.groups:
        for rank, place in zip(group.ranks, group.places, strict=False):
            out[f"rank {rank.name}"] = place.pid
    return out


async def _drive(
    address: str, config: SoakConfig, pool: list[PromptSpec], references: list[list[int]]
) -> _Counts:
    rng = random.Random(config.seed + 1)
    plan = [(rng.randrange(len(pool)), rng.random() < config.cancel_fraction) for _ in range(config.requests)]
    counts = _Counts()
    gate = asyncio.Semaphore(config.concurrency)
    async with channel(ClientOptions(address)) as ch:
        stub = tandem_pb2_grpc.TandemStub(ch)

        async def one(index: int, entry: int, cancel: bool) -> None:
            spec, want = pool[entry], references[entry]
            cancel_after = random.Random(index).randrange(len(want) + 1) if cancel else None
            got: list[int] = []
            async with gate:
                call = stub.Generate(request_message(spec, request_id=f"soak-{index}"))
                if cancel_after == 0:  # before any token: a moment after the request went out
                    await asyncio.sleep(random.Random(-index).uniform(0.0, 0.05))
                    call.cancel()
                    counts.cancelled += 1
                    return
                try:
                    async for response in call:
                        if response.HasField("chunk"):
                            got += response.chunk.token_ids
                            if cancel_after is not None and len(got) >= cancel_after:
                                call.cancel()
                                break
                        elif list(response.summary.token_ids) == want and not response.summary.error:
                            counts.completed += 1
                            return
                        else:
                            counts.fail(f"request {index}: {response.summary.error or 'tokens differ'}")
                            return
                except grpc.aio.AioRpcError as exc:
                    if exc.code() != grpc.StatusCode.CANCELLED or cancel_after is None:
                        counts.fail(f"request {index}: {exc.code().name} {exc.details()}")
                        return
            if cancel_after is None:
                counts.fail(f"request {index}: the stream ended without a summary")
            elif got != want[: len(got)]:
                counts.fail(f"request {index}: cancelled after tokens that differ from the reference")
            else:
                counts.cancelled += 1

        await asyncio.gather(*[one(i, entry, cancel) for i, (entry, cancel) in enumerate(plan)])
    return counts


def _all_free(stats: list[RankStats]) -> bool:
    return all(
        s.free_pages == s.total_pages
        and s.sends_in_flight == s.receives_in_flight == 0
        and s.queued + s.running + s.waiting_for_kv + s.computing + s.transferring == 0
        for s in stats
    )


def run_soak(config: SoakConfig, model_dir: Path | None = None) -> dict[str, Any]:
    if config.requests < 1 or config.concurrency < 1:
        raise ValueError("--requests and --concurrency must be at least 1")
    if not 0 <= config.cancel_fraction <= 1:
        raise ValueError(f"--cancel-fraction: must be in [0, 1], got {config.cancel_fraction}")
    topology = Topology.preset(config.preset)
    with tempfile.TemporaryDirectory() as tmp:
        model = model_dir or make_tiny_checkpoint(Path(tmp) / "tiny", seed=0)
        engine_config = EngineConfig(page_size=topology.decode.page_size, num_pages=4096)
        engine = ColocatedEngine.from_model_dir(model, DTYPES[config.dtype], engine_config)
        pool = _pool(config, engine.model_config.vocab_size)
        outputs = engine.generate([p.token_ids or [] for p in pool], [p.sampling for p in pool])
        references = [o.token_ids for o in outputs]
        del engine
        server = Server(ServeOptions(topology, model, port=0, dtype=config.dtype))
        server.start()
        try:
            return _soak(server, config, pool, references)
        finally:
            server.stop()


def _soak(
    server: Server, config: SoakConfig, pool: list[PromptSpec], references: list[list[int]]
) -> dict[str, Any]:
    pids = _pids(ray.get(server.controller.routing_view.remote()))
    samples: list[tuple[float, dict[str, float]]] = []
    done = asyncio.Event()

    async def sample() -> None:
        while not done.is_set():
            readings = {name: _rss_mib(pid) for name, pid in pids.items()}
            samples.append((time.monotonic(), {n: r for n, r in readings.items() if r is not None}))
            await asyncio.sleep(config.rss_interval_s)

    async def main() -> _Counts:
        sampler = asyncio.create_task(sample())
        try:
            return await _drive(f"127.0.0.1:{server.port}", config, pool, references)
        finally:
            done.set()
            await sampler

    start = time.monotonic()
    counts = asyncio.run(main())
    wall_s = time.monotonic() - start
    deadline = time.monotonic() + 60  # cancelled requests free their pages a moment later
    while not (free := _all_free(ray.get(server.controller.stats.remote()))) and time.monotonic() < deadline:
        time.sleep(0.2)
    integrity = "ok"
    try:
        ray.get(server.controller.check_integrity.remote())
    except Exception as exc:  # the accounting error, as the rank raised it
        integrity = f"{type(exc).__name__}: {exc}"
    growth = _rss_growth(samples)
    grown = {name: g for name, g in growth.items() if g > config.rss_slack_mib}
    return {
        "requests": config.requests,
        "concurrency": config.concurrency,
        "completed": counts.completed,
        "cancelled": counts.cancelled,
        "wrong": counts.wrong,
        "first_wrong": counts.first_wrong,
        "pages_free": free,
        "integrity": integrity,
        "wall_s": round(wall_s, 1),
        "requests_per_s": round(config.requests / wall_s, 1),
        "rss_growth_second_half_mib": {n: round(g, 1) for n, g in sorted(growth.items())},
        "rss_end_mib": {n: round(r, 1) for n, r in sorted(samples[-1][1].items())} if samples else {},
        "ok": counts.wrong == 0 and free and integrity == "ok" and not grown,
    }


def _rss_growth(samples: list[tuple[float, dict[str, float]]]) -> dict[str, float]:
    """Per process: the median of the last tenth of the samples minus the median of the tenth
    that starts the second half (medians: one sample caught mid-collection does not count)."""
    half = samples[len(samples) // 2 :]
    if len(half) < 2:
        return {}
    width = max(1, len(half) // 10)
    growth = {}
    for name in half[0][1]:
        early = [s[name] for _, s in half[:width] if name in s]
        late = [s[name] for _, s in half[-width:] if name in s]
        if early and late:
            growth[name] = statistics.median(late) - statistics.median(early)
    return growth
