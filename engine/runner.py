"""The model runner: a scheduler's plan -> tensors -> model -> sampled tokens."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from tandem.engine.sampling_runner import SamplingRunner
from tandem.engine.scheduler_output import SchedulerOutput
from tandem.engine.static_decode import StaticDecode
from tandem.model.attention_metadata import AttentionMetadata
from tandem.model.deepseek import DeepseekV3
from tandem.model.grammar import GuidedRows
from tandem.model.kv_pool import KVPool


class ModelRunner(SamplingRunner):
    """DeepSeek-V3's runner: a plan's chunks as one packed batch over the paged latent pool
    (``SamplingRunner`` says ``lockstep``, ``guides``, ``guard_syncs``, ``keep_hidden``)."""

    def __init__(
        self,
        model: DeepseekV3,
        pool: KVPool,
        lockstep: bool = False,
        static: StaticDecode | None = None,
        mtp_prefill: bool = False,
        keep_hidden: bool = False,
        guides: GuidedRows | None = None,
        guard_syncs: bool | None = None,
    ) -> None:
        """``static``: decode batches run at their bucket's shape (CUDA graphs on a GPU).
        ``mtp_prefill``: each chunk's MTP-layer KV is computed after the model's (a prefill rank
        of a deployment that drafts with MTP), and the last hidden state of each sampling chunk
        is kept (``hidden_state``)."""
        if mtp_prefill and model.mtp is None:
            raise ValueError("mtp_prefill needs a model built with its MTP layer")
        super().__init__(model, lockstep, guides, guard_syncs, keep_hidden or mtp_prefill)
        self.model = model
        self.pool = pool
        self.static = static
        self.mtp_prefill = mtp_prefill

    def run(
        self,
        plan: SchedulerOutput,
        on_layer_kv: Callable[[int], None] | None = None,
        exports: Mapping[str, int] | None = None,
    ) -> dict[str, int]:
        """Compute the planned chunks' KV and sample a token for each chunk that asks for one;
        ``on_layer_kv(layer)`` runs as each layer's KV lands in the pool (see the model). A V3
        request's state is all in its pages: there are no ``exports`` (``V4Runner.run``)."""
        if exports:
            raise ValueError("DeepSeek-V3's requests have no state beside their pages to export")
        if any(c.draft_token_ids for c in plan.chunks):
            raise ValueError("a plan with drafts is verified (ModelRunner.verify), not run")
        return {rid: tokens[0] for rid, tokens in self.verify(plan, on_layer_kv).items()}

    def verify(
        self, plan: SchedulerOutput, on_layer_kv: Callable[[int], None] | None = None
    ) -> dict[str, tuple[int, ...]]:
        """As ``run``, for plans whose chunks may end with drafts: each sampling chunk's tokens,
        the target's samples its drafts earned (``engine/speculation.accept``), 1 to 1 + drafts.

        A verify chunk's positions are attention rows of one token each over the request's pages
        (row ``j`` sees positions ``.. start + j``; every position's KV is stored before any row
        attends): the arithmetic of plain decode steps at those positions, so a greedy token is
        the one plain decoding computes, and the shapes of a decode batch (``StaticDecode``)."""
        if not plan.chunks and not self.lockstep:
            return {}
        start = time.perf_counter()
        self._hidden, self._hidden_at = None, {}
        self.logprobs, self.prompt_logprobs = {}, {}
        prompt_rows = any(c.prompt_logprob_targets for c in plan.chunks)
        if self.static is not None:  # in a DEP group, every rank agrees on the bucket every step
            size = self.static.step_bucket(plan, eligible=on_layer_kv is None and not prompt_rows)
            if size is not None:
                static = self.static

                def static_forward(p: SchedulerOutput) -> torch.Tensor:
                    return static.run(p, size, self._guarded)

                return self._sample(plan, static_forward, start)
        device = self.model.device
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        page_lists: list[list[int]] = []
        offsets: list[int] = []  # each chunk's first row in the packed batch
        for chunk in plan.chunks:
            offsets.append(len(input_ids))
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_position, chunk.start_position + len(chunk.token_ids)))
            if chunk.sample:
                end = len(input_ids)
                sample_rows.extend(range(end - chunk.num_sampled, end))
            pages = list(chunk.page_ids)
            if chunk.draft_token_ids:  # each position a decode row of its own: see verify
                query_lens.extend([1] * len(chunk.token_ids))
                seq_lens.extend(
                    range(chunk.start_position + 1, chunk.start_position + len(chunk.token_ids) + 1)
                )
                page_lists.extend([pages] * len(chunk.token_ids))
            else:
                query_lens.append(len(chunk.token_ids))
                seq_lens.append(chunk.start_position + len(chunk.token_ids))
                page_lists.append(pages)
        meta = AttentionMetadata.build(self.pool.page_size, query_lens, seq_lens, page_lists, device)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
        pos = torch.tensor(positions, dtype=torch.int64, device=device)

        def forward(_: SchedulerOutput) -> torch.Tensor:
            with self._guarded():
                hidden = self.model.forward(ids, pos, meta, self.pool, on_layer_kv)
            if self.mtp_prefill:
                self._mtp_rows(plan, ids, pos, hidden, on_layer_kv)
            if prompt_rows:
                self._prompt_logprobs(plan, offsets, hidden)
            return hidden[torch.tensor(sample_rows, device=device)] if sample_rows else hidden[:0]

        return self._sample(plan, forward, start)

    def _mtp_rows(
        self,
        plan: SchedulerOutput,
        ids: torch.Tensor,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        on_layer_kv: Callable[[int], None] | None,
    ) -> None:
        """The MTP layer's KV for each chunk's positions whose next token is known: row ``p``
        reads the token at ``p + 1`` (the chunk's next, then ``next_token_id``) and the hidden
        state at ``p``. A prompt's last position waits for the decode rank, which knows its next
        token (the first output, or after a preemption the last one) and gets that hidden state."""
        device = self.model.device
        take: list[int] = []  # rows of the packed batch that get an MTP row
        next_ids: list[int] = []
        lens, ends, pages = [], [], []
        at = 0
        for chunk in plan.chunks:
            n = len(chunk.token_ids)
            following = list(chunk.token_ids[1:])
            if chunk.next_token_id is not None:
                following.append(chunk.next_token_id)
            if following:
                take.extend(range(at, at + len(following)))
                next_ids.extend(following)
                lens.append(len(following))
                ends.append(chunk.start_position + len(following))
                pages.append(list(chunk.page_ids))
            at += n
        index = torch.tensor(take, dtype=torch.int64, device=device)
        meta = AttentionMetadata.build(self.pool.page_size, lens, ends, pages, device)
        mtp_ids = torch.tensor(next_ids, dtype=torch.int64, device=device)
        self.model.mtp_forward(mtp_ids, positions[index], hidden[index], meta, self.pool, on_layer_kv)
