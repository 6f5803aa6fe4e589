"""DeepSeek-V4's runner: a plan's chunks through :class:`~tandem.model.v4.model.DeepseekV4` as
one mixed step (prefill chunks and decode rows together), each request's state held here from
one step to the next: per layer its sliding window's KV, its compressed entries and indexer
keys, and its compressors' open windows and overlap (``model/v4/attention.LayerState``).

A chunk continues its request's state where the last one ended, so the request's tokens are the
same whatever the chunking (``--prefill-chunk-tokens``) and the batch. A chunk at position 0
starts a fresh state: a new request, or one preempted and recomputed. A chunk anywhere else
must find the state at its position: V4's exact restore of a prefix-cache hit is not built, so
the engine runs V4 without prefix caching, and a chunk this runner has no state for is refused
with the request named rather than run on a wrong state. A step whose forward fails drops its
requests' states (they moved part of the way). A request's state goes with it (``forget``)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tandem.engine.sampling_runner import SamplingRunner
from tandem.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from tandem.model.grammar import GuidedRows
from tandem.model.v4.attention import LayerState
from tandem.model.v4.model import DeepseekV4


@dataclass
class _Held:
    position: int  # the tokens this state has seen
    layers: list[LayerState]


class V4Runner(SamplingRunner):
    def __init__(
        self,
        model: DeepseekV4,
        lockstep: bool = False,
        guides: GuidedRows | None = None,
        guard_syncs: bool | None = None,
    ) -> None:
        super().__init__(model, lockstep, guides, guard_syncs)
        self.model = model
        self.states: dict[str, _Held] = {}

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self.states.pop(request_id, None)

    def verify(self, plan: SchedulerOutput) -> dict[str, tuple[int, ...]]:
        if any(c.draft_token_ids for c in plan.chunks):
            raise ValueError("speculative drafts for DeepSeek-V4 are not built: serve it without drafts")
        if not plan.chunks and not self.lockstep:
            return {}
        start = time.perf_counter()
        self._hidden, self._hidden_at = None, {}
        self.logprobs, self.prompt_logprobs = {}, {}
        held = [self._state(c) for c in plan.chunks]
        device = self.model.device
        input_ids: list[int] = []
        positions: list[int] = []
        sample_rows: list[int] = []
        offsets: list[int] = []
        for chunk in plan.chunks:
            offsets.append(len(input_ids))
            input_ids.extend(chunk.token_ids)
            positions.extend(range(chunk.start_position, chunk.start_position + len(chunk.token_ids)))
            if chunk.sample:
                sample_rows.extend(range(len(input_ids) - chunk.num_sampled, len(input_ids)))
        ids = torch.tensor(input_ids, dtype=torch.int64, device=device)
        pos = torch.tensor(positions, dtype=torch.int64, device=device)
        query_lens = [len(c.token_ids) for c in plan.chunks]
        prompt_rows = any(c.prompt_logprob_targets for c in plan.chunks)

        def forward(_: SchedulerOutput) -> torch.Tensor:
            try:
                with self._guarded():
                    hidden = self.model.forward(ids, pos, query_lens, [h.layers for h in held])
            except BaseException:
                for chunk in plan.chunks:  # part-moved states: a later chunk is refused, not misrun
                    self.states.pop(chunk.request_id, None)
                raise
            for h, n in zip(held, query_lens, strict=True):
                h.position += n
            if prompt_rows:
                self._prompt_logprobs(plan, offsets, hidden)
            return hidden[torch.tensor(sample_rows, device=device)] if sample_rows else hidden[:0]

        return self._sample(plan, forward, start)

    def _state(self, chunk: ScheduledChunk) -> _Held:
        rid = chunk.request_id
        if chunk.start_position == 0:
            self.states[rid] = _Held(0, self.model.new_state())
        held = self.states.get(rid)
        if held is None or held.position != chunk.start_position:
            at = "none" if held is None else f"position {held.position}"
            raise ValueError(
                f"request {rid}: a DeepSeek-V4 chunk at position {chunk.start_position}, its state at {at} "
                "(V4 runs without prefix caching)"
            )
        return held
