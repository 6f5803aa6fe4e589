"""A DEP group of prefill or decode ranks: the group machinery of :class:`DEPGroup` (placement,
rendezvous, failure detection, gang restart) with :class:`RoleRankActor` ranks."""

from __future__ import annotations

from typing import Any

from tandem.cluster.dep_group import DEPGroup, DEPGroupConfig
from tandem.cluster.role_actor import RoleRankActor, RoleRankSpec
from tandem.cluster.topology import PoolSpec
from tandem.decode.worker import Bill, DecodeResult
from tandem.engine.dep_rank import RankRequest


class RoleGroup(DEPGroup):
    def __init__(
        self,
        config: DEPGroupConfig,
        role: str,
        pool: PoolSpec,
        layerwise: bool = True,
        kv_timeout_s: float = 30.0,
    ) -> None:
        if role not in ("prefill", "decode"):
            raise ValueError(f"role must be prefill or decode, got {role!r}")
        super().__init__(config)
        self.role, self.pool, self.layerwise, self.kv_timeout_s = role, pool, layerwise, kv_timeout_s

    def rank_name(self, rank: int) -> str:
        return f"{self.group_id}-r{rank}"

    def _actor_class(self) -> Any:
        return RoleRankActor

    def _spec(self, rank: int) -> RoleRankSpec:
        cfg, pool = self.config, self.pool
        return RoleRankSpec(
            role=self.role,
            name=self.rank_name(rank),
            model_dir=cfg.model_dir,
            dtype=cfg.dtype,
            group_id=cfg.group_id,
            incarnation=self.incarnation,
            rank=rank,
            world_size=cfg.size,
            num_pages=pool.num_pages,
            page_size=pool.page_size,
            max_num_seqs=pool.max_num_seqs,
            max_num_batched_tokens=pool.max_num_batched_tokens,
            layerwise=self.layerwise,
            kv_timeout_s=self.kv_timeout_s,
            collective_timeout_s=cfg.collective_timeout_s,
        )

    def _submit_call(self, actor: Any, requests: list[RankRequest]) -> Any:
        return actor.submit_requests.remote(requests)

    def _signals_rank_failure(self, result: Any) -> bool:
        """A request's own error (a failed transfer) is no rank failure; a failed loop ends its
        ``run`` call, which the group watches."""
        return False

    def _error_result(self, request_id: str, message: str) -> DecodeResult:
        return DecodeResult(request_id, [], "error", message, None, "", Bill())

    def named_actors(self) -> dict[str, Any]:
        return {self.rank_name(rank): actor for rank, actor in enumerate(self.actors)}
