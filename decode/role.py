"""A decode rank's role: its KV pool and batch limits, and how long it waits for a prompt's KV."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from tandem.engine.role_spec import PooledRole
from tandem.engine.speculation import SpeculativeConfig
from tandem.wire.messages import Role

if TYPE_CHECKING:
    from tandem.engine.rank_context import RankContext
    from tandem.engine.rank_loop import RankWorker


@dataclass(frozen=True, kw_only=True)
class DecodeRole(PooledRole):
    role: ClassVar[Role] = Role.DECODE
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    @property
    def uses_mtp(self) -> bool:
        return self.speculative.enabled and self.speculative.drafter == "mtp"

    def build(self, ctx: RankContext) -> RankWorker:
        # here, on the rank: the worker's modules load torch, this one must not
        from tandem.decode.dispatch import RayPrefillDispatcher
        from tandem.decode.scheduler import DecodeScheduler
        from tandem.decode.types import DecodeSchedulerConfig
        from tandem.decode.worker import DecodeWorker
        from tandem.engine.drafters import make_drafter
        from tandem.model.v4.kv_layout import transfer_slots

        cfg = ctx.model_config
        v4 = ctx.v4 is not None
        spec = self.speculative
        # V4 with a store: completed pages keep their window KV and overlap in window slots, so a
        # finished request's pages are written back with what a next turn's hit ends on
        pool = ctx.kv_pool(self.num_pages, self.page_size, prefix_caching=v4 and self.store is not None)
        slots = ctx.state_slots(transfer_slots(False, self.max_num_seqs))  # V4: of KV on its way
        config = DecodeSchedulerConfig(
            num_pages=self.num_pages,
            page_size=self.page_size,
            max_num_seqs=self.max_num_seqs,
            max_model_len=cfg.max_position_embeddings,
            kv_wait_timeout_s=self.kv_timeout_s,
        )
        dispatcher = RayPrefillDispatcher(self.page_size)
        writeback = ctx.tiers(pool, 0, self.store, self.model_key, self.store_secret)
        if v4:  # drafts: every step verifies, the group agreeing on rejected drafts' recompute
            runner = ctx.v4_runner(
                pool, slots, writeback is not None, speculative=spec.enabled, keep_hidden=self.uses_mtp
            )
            if writeback is not None:
                writeback.tiers.boundary = runner
            return DecodeWorker(
                ctx.rank_id, ctx.incarnation, DecodeScheduler(config), runner,
                ctx.transport(pool, slots), dispatcher, self.kv_timeout_s, model_config=cfg,
                outbox=ctx.outbox, state_slots=slots.num_slots if slots is not None else 0,
                writeback=writeback, speculative=spec,
                drafter=make_drafter(spec, model=ctx.v4, runner=runner) if spec.enabled else None,
            )  # fmt: skip
        drafter = make_drafter(spec, model=ctx.v3, pool=pool) if spec.enabled else None
        return DecodeWorker(
            ctx.rank_id, ctx.incarnation, DecodeScheduler(config),
            ctx.runner(pool, self.max_num_seqs * (1 + spec.num_tokens), keep_hidden=self.uses_mtp),
            ctx.transport(pool), dispatcher, self.kv_timeout_s, model_config=cfg, outbox=ctx.outbox,
            speculative=spec, drafter=drafter,
            writeback=writeback,
        )  # fmt: skip
