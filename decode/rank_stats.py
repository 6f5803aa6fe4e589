"""What a decode rank reports of itself (``RankStats``): its scheduler's counts, its transfers,
its speculation, where its loop's time went, its tiers."""

from __future__ import annotations

from typing import Protocol

from tandem.decode.scheduler import DecodeScheduler
from tandem.engine.sampling_runner import SamplingRunner
from tandem.engine.tier_copier import TierCopier
from tandem.kvtransfer.transport import KVTransport
from tandem.kvtransfer.types import FailureCounts
from tandem.wire.messages import LoopStats, RankId, RankStats, Role, Speculation, TierStats


class DecodeRank(Protocol):
    """What the report reads of a decode rank's worker (``DecodeWorker``)."""

    rank_id: RankId
    incarnation: int
    scheduler: DecodeScheduler
    transport: KVTransport
    writeback: TierCopier | None
    kv_bytes_received: int
    preemptions: int
    speculation: Speculation
    failure_counts: FailureCounts

    @property
    def runner(self) -> SamplingRunner: ...

    def step_times(self) -> tuple[float, float, float]: ...


def decode_rank_stats(worker: DecodeRank, loop: LoopStats) -> RankStats:
    d = worker.scheduler
    sends, receives = worker.transport.in_flight()
    return RankStats(
        rank=worker.rank_id,
        role=Role.DECODE,
        incarnation=worker.incarnation,
        loop=loop,
        queued=d.num_queued,
        running=d.num_running,
        waiting_for_kv=d.num_waiting_for_kv,
        free_pages=d.num_free_pages,
        total_pages=d.config.num_pages,
        kv_bytes_received=worker.kv_bytes_received,
        sends_in_flight=sends,
        peers_connected=worker.transport.connected_peers(),
        receives_in_flight=receives,
        preemptions=worker.preemptions,
        speculation=worker.speculation,
        transfer_failures=worker.failure_counts.as_tuple(),
        weight_bytes=worker.runner.weight_bytes,
        forward_s=worker.runner.stats.forward_s,
        split=worker.runner.split(*worker.step_times()),
        tiers=worker.writeback.tiers.stats() if worker.writeback is not None else TierStats(),
    )
