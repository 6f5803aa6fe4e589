"""How one rank's engine is sized (pages, batch limits, context); free of torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.model.v4.kv_layout import WINDOW_SHARE

if TYPE_CHECKING:
    from tandem.model.family import AnyConfig


@dataclass(frozen=True)
class EngineConfig:
    """How one rank's engine is sized. ``num_pages`` wins over ``kv_pool_bytes`` when set."""

    page_size: int = 64
    num_pages: int | None = None
    kv_pool_bytes: int = 256 * 1024 * 1024
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    prefill_chunk_tokens: int | None = None  # the most prompt tokens one request computes in a step
    enable_prefix_caching: bool = True
    # DeepSeek-V4: the share of pages whose window KV and overlap the prefix cache keeps, in
    # slots (``engine/window_slots.py``; a quarter)
    v4_window_share: float = WINDOW_SHARE

    def context_len(self, cfg: AnyConfig) -> int:
        """Tokens a request may hold (prompt + output): the model's context, or less if set."""
        return min(self.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
