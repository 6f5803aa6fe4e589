"""A rank's role, as the process that starts the rank describes it: sizes and timeouts, free
of torch. The rank builds its worker from it once its model is loaded (``build``), so the
controller and the CLI can describe prefill, decode and colocated ranks without loading torch.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar

from tandem.kvtransfer.kv_store import StoreConfig
from tandem.wire.messages import Role

if TYPE_CHECKING:
    from tandem.engine.rank_context import RankContext
    from tandem.engine.rank_loop import RankWorker


class RoleSpec(ABC):
    role: ClassVar[Role]
    # how long an idle rank waits for work before it joins the group's next agreement
    idle_wait_s: ClassVar[float] = 0.005

    @property
    def uses_mtp(self) -> bool:
        """Whether the rank loads the checkpoint's MTP layer (and its pool holds that layer)."""
        return False

    @abstractmethod
    def build(self, ctx: RankContext) -> RankWorker:
        """The rank's worker, over the model and place in its group that ``ctx`` holds; runs on
        the rank."""


@dataclass(frozen=True, kw_only=True)
class PooledRole(RoleSpec, ABC):
    """A role of the disaggregated cluster: a KV pool of its own and a deadline on every KV
    transfer."""

    num_pages: int
    page_size: int
    max_num_seqs: int
    kv_timeout_s: float = 30.0
    # the KV tiers below the device pages: host-memory pages of the rank's own (a prefill or
    # colocated rank's), and the shared store (``None``: none), keyed by ``model_key``
    host_cache_pages: int = 0
    store: StoreConfig | None = None
    model_key: str = ""
    # signs and keys the store's blocks (``engine/kv_block_codec.py``); never shown
    store_secret: bytes = field(default=b"", repr=False)
