"""What a role builds its worker from, on the rank (only rank processes import this: torch)."""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tandem.engine.dep import ExpertParallelDispatcher
from tandem.engine.kv_tiers import TierConfig
from tandem.engine.outbox import Outbox
from tandem.engine.runner import ModelRunner
from tandem.engine.static_decode import StaticDecode, static_decode_enabled
from tandem.engine.tier_copier import (
    TierCopier,
    boundary_bytes,
    boundary_share,
    build_tiers,
    page_bytes,
    pool_block_layout,
)
from tandem.engine.v4_runner import V4Runner
from tandem.kvtransfer.kv_store import StoreConfig, StoreError
from tandem.kvtransfer.metadata import RayMetadataStore
from tandem.kvtransfer.nixl_transport import NixlTransport
from tandem.kvtransfer.stores import open_store
from tandem.model.deepseek import DeepseekV3
from tandem.model.family import AnyConfig
from tandem.model.grammar import GrammarCompiler, GuidedRows
from tandem.model.kv_pool import KVPool
from tandem.model.loader import AnyModel
from tandem.model.tokenizer import TOKENIZER_FILE, Tokenizer
from tandem.model.v4.model import DeepseekV4
from tandem.model.v4.pages import transfer_layout, v4_pool
from tandem.model.v4.state_slots import StateSlots
from tandem.wire.messages import RankId

log = logging.getLogger(__name__)


def guided_rows(model_dir: str, vocab_size: int) -> GuidedRows | None:
    """Structured outputs over the model's vocabulary (``None``: the directory has no tokenizer,
    and the edge refuses guided requests)."""
    if not model_dir or not (Path(model_dir) / TOKENIZER_FILE).is_file():
        return None
    tokenizer = Tokenizer.from_dir(model_dir)
    return GuidedRows(GrammarCompiler(tokenizer, vocab_size), tokenizer.eos_token_id)


@dataclass(frozen=True)
class RankContext:
    """What a role builds its worker from: the rank's id, its model and device, and its outbox."""

    rank_id: RankId
    incarnation: int
    model_config: AnyConfig
    model: AnyModel
    dispatcher: ExpertParallelDispatcher
    device: torch.device
    dtype: torch.dtype
    outbox: Outbox
    model_key: str = ""  # the checkpoint's fingerprint: names its blocks in the shared store
    model_dir: str = ""  # its tokenizer gives structured outputs their vocabulary
    node_address: str = "127.0.0.1"  # its node's: where its store client is reached and listens

    @property
    def v3(self) -> DeepseekV3:
        """The model, for what serves DeepSeek-V3 alone (its runner with static decode, its
        drafters)."""
        if not isinstance(self.model, DeepseekV3):
            raise ValueError(
                f"rank {self.rank_id.name}: this part serves DeepSeek-V3 only, and the model is V4"
            )
        return self.model

    @property
    def v4(self) -> DeepseekV4 | None:
        """The model when it is a DeepSeek-V4 (``None`` for V3)."""
        return self.model if isinstance(self.model, DeepseekV4) else None

    def kv_pool(self, num_pages: int, page_size: int, prefix_caching: bool = False) -> KVPool:
        """The rank's pool: V3's latent pages, or V4's kinds (``prefix_caching``: with the window
        KV and overlap a hit restores from, for a share of the pages)."""
        if self.v4 is not None:
            return v4_pool(self.v4.cfg, num_pages, page_size, self.dtype, self.device, prefix_caching)
        model = self.v3
        return KVPool(model.cfg, num_pages, page_size, self.dtype, self.device, model.num_kv_layers)

    def state_slots(self, slots: int) -> StateSlots | None:
        """Slots of V4 requests' bounded state, for the transfers of ``slots`` requests at once
        (``None`` for V3, whose requests are all in their pages)."""
        if self.v4 is None:
            return None
        return StateSlots(self.v4.cfg, slots, self.dtype, self.device, mtp=self.v4.mtp is not None)

    def v4_runner(
        self,
        pool: KVPool,
        slots: StateSlots | None,
        prefix_caching: bool = False,
        speculative: bool = False,
        mtp_prefill: bool = False,
        keep_hidden: bool = False,
    ) -> V4Runner:
        """DeepSeek-V4's runner over ``pool`` in lockstep with the group, packing and taking
        requests' bounded state in ``slots``; ``speculative``: its steps verify drafts;
        ``mtp_prefill``, ``keep_hidden``: for MTP drafts (``V4Runner``)."""
        assert self.v4 is not None
        guides = guided_rows(self.model_dir, self.model_config.vocab_size)
        return V4Runner(
            self.v4,
            True,
            guides,
            pool=pool,
            prefix_caching=prefix_caching,
            state_slots=slots,
            speculative=speculative,
            mtp_prefill=mtp_prefill,
            keep_hidden=keep_hidden,
        )

    def runner(
        self, pool: KVPool, max_batch: int | None = None, mtp_prefill: bool = False, keep_hidden: bool = False
    ) -> ModelRunner:
        """The model over ``pool``, stepping in lockstep with the group; a role that decodes
        gives its ``max_batch``, and its decode batches run at static shapes where that is on
        (``static_decode_enabled``: CUDA graphs on a GPU)."""
        static = None
        model = self.v3
        if max_batch is not None and static_decode_enabled(self.device.type):
            static = StaticDecode(model, pool, max_batch, model.cfg.max_position_embeddings)
            static.capture_all()  # at start, every rank of the group together (graphs on a GPU)
        return ModelRunner(
            model,
            pool,
            lockstep=True,
            static=static,
            mtp_prefill=mtp_prefill,
            keep_hidden=keep_hidden,
            guides=guided_rows(self.model_dir, self.model_config.vocab_size),
        )

    def tiers(
        self,
        pool: KVPool,
        host_pages: int,
        store: StoreConfig | None,
        model_key: str = "",
        secret: bytes = b"",
    ) -> TierCopier | None:
        """The host tier and the store client over ``pool`` (``None`` with neither), its blocks
        signed with the deployment's ``secret``. A store that cannot be reached at start is
        logged and left out: the rank serves without it."""
        if host_pages <= 0 and store is None:
            return None
        client = None
        if store is not None:
            try:
                client = open_store(replace(store, local_hostname=self.node_address))
            except StoreError as error:
                log.warning("rank %s serves without the KV store: %s", self.rank_id.name, error)
        if host_pages <= 0 and client is None:
            return None
        config = TierConfig(
            host_pages=host_pages,
            store=client,
            model=model_key or self.model_key,
            layout=pool_block_layout(pool),
            page_bytes=page_bytes(pool),
            secret=secret,
            boundary_bytes=boundary_bytes(pool),
            boundary_share=boundary_share(pool),
        )
        return build_tiers(pool, config)[1]

    def transport(self, pool: KVPool, slots: StateSlots | None = None) -> NixlTransport:
        """This rank's NIXL agent over ``pool`` (V4: the kinds a running request reads, and its
        state ``slots``), its metadata published in Ray's GCS."""
        layout = transfer_layout(pool, slots) if slots is not None else pool.layout
        return NixlTransport(self.rank_id.name, self.incarnation, layout, RayMetadataStore())
