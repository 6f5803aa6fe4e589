"""A prefill rank's role: its KV pool (a prefix cache), its batch limits and how its KV leaves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from tandem.engine.role_spec import PooledRole
from tandem.wire.messages import Role

if TYPE_CHECKING:
    from tandem.engine.rank_context import RankContext
    from tandem.engine.rank_loop import RankWorker


@dataclass(frozen=True, kw_only=True)
class PrefillRole(PooledRole):
    role: ClassVar[Role] = Role.PREFILL
    max_num_batched_tokens: int
    layerwise: bool = True  # post each layer's writes as soon as it is computed
    mtp: bool = False  # compute the MTP layer's KV too (its decode ranks draft with MTP)
    max_jobs: int | None = None  # jobs held at once; one more is refused (None: no limit)
    prefill_chunk_tokens: int | None = None  # the most prompt tokens one job computes in a step

    @property
    def uses_mtp(self) -> bool:
        return self.mtp

    def build(self, ctx: RankContext) -> RankWorker:
        # here, on the rank: the worker's modules load torch, this one must not
        from tandem.prefill.scheduler import PrefillScheduler, PrefillSchedulerConfig
        from tandem.prefill.worker import PrefillWorker

        cfg = ctx.v3.cfg
        pool = ctx.kv_pool(self.num_pages, self.page_size)
        copier = ctx.tiers(pool, self.host_cache_pages, self.store, self.model_key, self.store_secret)
        scheduler = PrefillScheduler(
            PrefillSchedulerConfig(
                num_pages=self.num_pages,
                page_size=self.page_size,
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=self.max_num_batched_tokens,
                max_model_len=cfg.max_position_embeddings,
                vocab_size=cfg.vocab_size,
                prefill_chunk_tokens=self.prefill_chunk_tokens,
            ),
            copier.tiers if copier is not None else None,
        )
        return PrefillWorker(
            ctx.rank_id,
            ctx.incarnation,
            scheduler,
            ctx.runner(pool, mtp_prefill=self.mtp),
            ctx.transport(pool),
            self.layerwise,
            self.kv_timeout_s,
            model_config=cfg,
            outbox=ctx.outbox,
            copier=copier,
            max_jobs=self.max_jobs,
        )
