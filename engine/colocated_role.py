"""A colocated rank's role: prefill and decode on one rank over one KV pool, no transfer."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from tandem.engine.engine_config import EngineConfig
from tandem.engine.role_spec import RoleSpec
from tandem.kvtransfer.kv_store import StoreConfig
from tandem.wire.messages import Role

if TYPE_CHECKING:
    from tandem.engine.rank_context import RankContext
    from tandem.engine.rank_loop import RankWorker


@dataclass(frozen=True)
class ColocatedRole(RoleSpec):
    role: ClassVar[Role] = Role.COLOCATED
    idle_wait_s: ClassVar[float] = 0.02  # nothing arrives by transfer: no need to look often
    engine: EngineConfig = field(default_factory=EngineConfig)
    host_cache_pages: int = 0  # the rank's host tier (see ``PooledRole``)
    store: StoreConfig | None = None  # the shared store
    model_key: str = ""
    store_secret: bytes = field(default=b"", repr=False)  # signs and keys its blocks

    def build(self, ctx: RankContext) -> RankWorker:
        from tandem.engine.colocated import ColocatedEngine
        from tandem.engine.colocated_worker import ColocatedWorker
        from tandem.engine.rank_context import guided_rows

        guides = guided_rows(ctx.model_dir, ctx.model_config.vocab_size)
        engine = ColocatedEngine(ctx.model, self.engine, lockstep=True, guides=guides)
        if engine.pool is not None:  # V4's kinds too: a page's window KV and overlap go with it
            copier = ctx.tiers(
                engine.pool, self.host_cache_pages, self.store, self.model_key, self.store_secret
            )
            if copier is not None:
                engine.attach_tiers(copier)
        return ColocatedWorker(ctx.rank_id, ctx.incarnation, engine, ctx.dispatcher, ctx.outbox)
