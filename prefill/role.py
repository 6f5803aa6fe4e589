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
        from tandem.engine.runner import ModelRunner
        from tandem.engine.v4_runner import V4Runner
        from tandem.model.v4.kv_layout import transfer_slots
        from tandem.prefill.scheduler import PrefillScheduler, PrefillSchedulerConfig
        from tandem.prefill.worker import PrefillWorker

        cfg = ctx.model_config
        v4 = ctx.v4 is not None
        # V4: its own prefix hits restore exact state from the window slots of its pool
        pool = ctx.kv_pool(self.num_pages, self.page_size, prefix_caching=v4)
        slots = ctx.state_slots(transfer_slots(True, self.max_num_seqs))  # V4: finishing requests'
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
        runner: ModelRunner | V4Runner
        if v4:
            runner = ctx.v4_runner(pool, slots, prefix_caching=True, mtp_prefill=self.mtp)
            scheduler.kv_cache.hit_pages = runner.hit_pages  # hits where the window is kept
            scheduler.kv_cache.better_holder = runner.slots.better_holder
            if copier is not None:  # a page's window KV and overlap go with it to the tiers
                copier.tiers.boundary = runner
        else:
            runner = ctx.runner(pool, mtp_prefill=self.mtp)
        return PrefillWorker(
            ctx.rank_id,
            ctx.incarnation,
            scheduler,
            runner,
            ctx.transport(pool, slots),
            self.layerwise,
            self.kv_timeout_s,
            model_config=cfg,
            outbox=ctx.outbox,
            copier=copier,
            max_jobs=self.max_jobs,
            state_slots=slots.num_slots if slots is not None else 0,
        )
