"""Drafts from the checkpoint's multi-token-prediction layer, run K times chained (DeepSeek-V3).

Per step, after ``schedule`` has given each request room for ``k`` drafts (pages included)::

    pass 1   rows p = q-m .. q-1 of each request: the positions whose next token became known
             since its last pass (m = the tokens the last verify step gave; 1 after its KV
             arrived, from the prefill rank's last hidden state). Row p reads the token at p+1
             and the target's hidden state at p: it writes the MTP layer's KV at p, and its last
             row's output g gives draft 0 (for the output the verify step samples at q, the
             next input position).
    pass j   one row per request with room > j, at position q+j-1: the draft j-1 and g of the
             previous pass; its output gives draft j. Its KV is speculative: the next pass 1
             writes those positions again once their tokens are known.

A draft is drawn as the target draws its token at that output index: the same sampling
parameters and the same noise, keyed by ``(seed, output index)`` (argmax for greedy), so the two
agree as often as their distributions allow. Every step runs the layer exactly ``K`` times, on
empty batches too: its MoE block exchanges rows with the DEP group's other ranks, which must run
it as often.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tandem.engine.drafter import Drafter
from tandem.engine.sampling_runner import seed_of
from tandem.model.attention_metadata import AttentionMetadata
from tandem.model.sampler import sample

if TYPE_CHECKING:
    from tandem.engine.request import Request
    from tandem.engine.speculation import SpeculativeConfig
    from tandem.model.deepseek import DeepseekV3
    from tandem.model.kv_pool import KVPool


class MtpDrafter(Drafter):
    needs_weights = True
    needs_hidden = True

    def __init__(self, config: SpeculativeConfig, *, model: DeepseekV3, pool: KVPool, **_: Any) -> None:
        if model.mtp is None:
            raise ValueError("drafter mtp: the model was loaded without its MTP layer")
        self.k = config.num_tokens
        self.model, self.pool = model, pool
        # request -> the target's hidden states [m, hidden] of the last m positions before its
        # next input, whose MTP rows are not computed yet
        self._pending: dict[str, torch.Tensor] = {}
        self._drafting: set[str] = set()  # requests that started from a prefill hidden state

    def start(self, request_id: str, hidden: Any = None) -> None:
        size = self.model.cfg.hidden_size
        if isinstance(hidden, bytes | bytearray) and len(hidden) == 4 * size:
            row = torch.from_numpy(np.frombuffer(hidden, dtype=np.float32).copy())
            self._pending[request_id] = row.view(1, size).to(self.model.device, self.model.dtype)
            self._drafting.add(request_id)
        # none sent (a prefill rank that does not run the MTP layer): this request drafts nothing

    def observe(self, request_id: str, accepted: Sequence[int], hidden: Any = None) -> None:
        if isinstance(hidden, torch.Tensor) and request_id in self._drafting:
            # a copy: a captured step's output buffer is written again by the next replay
            self._pending[request_id] = hidden[: len(accepted)].clone()

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._drafting.discard(request_id)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], k: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        model, device, page = self.model, self.model.device, self.pool.page_size
        rows = [r for r in requests if r.request_id in self._pending]
        # pass 1: every pending row of every request, in one ragged batch
        ids: list[int] = []
        positions: list[int] = []
        hidden: list[torch.Tensor] = []
        lens: list[int] = []
        for r in rows:
            h = self._pending.pop(r.request_id)
            m, q = h.shape[0], r.num_tokens - 1
            tokens = r.all_token_ids
            ids.extend(tokens[q - m + 1 : q + 1])
            positions.extend(range(q - m, q))
            hidden.append(h)
            lens.append(m)
        meta = AttentionMetadata.build(
            page, lens, [r.num_tokens - 1 for r in rows], [list(r.page_ids) for r in rows], device
        )
        g = model.mtp_forward(
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            torch.cat(hidden)
            if hidden
            else torch.empty((0, model.cfg.hidden_size), dtype=model.dtype, device=device),
            meta,
            self.pool,
        )
        last = torch.tensor(
            [sum(lens[: i + 1]) - 1 for i in range(len(rows))], dtype=torch.int64, device=device
        )
        g = g[last]
        drafts: dict[str, list[int]] = {r.request_id: [] for r in rows}
        active = rows
        for j in range(self.k):
            if j:  # a chained pass, at each request's position q + j - 1
                ids_j = [drafts[r.request_id][-1] for r in active]
                pos_j = [r.num_tokens - 1 + j - 1 for r in active]
                meta = AttentionMetadata.build(
                    page,
                    [1] * len(active),
                    [p + 1 for p in pos_j],
                    [list(r.page_ids) for r in active],
                    device,
                )
                g = model.mtp_forward(
                    torch.tensor(ids_j, dtype=torch.int64, device=device),
                    torch.tensor(pos_j, dtype=torch.int64, device=device),
                    g,
                    meta,
                    self.pool,
                )
            if active:
                draw_drafts(model.mtp_logits(g), active, drafts, j)
            keep = [i for i, r in enumerate(active) if k.get(r.request_id, 0) > j + 1]
            active = [active[i] for i in keep]
            g = g[torch.tensor(keep, dtype=torch.int64, device=device)]
        return {rid: tuple(d[: k.get(rid, 0)]) for rid, d in drafts.items() if k.get(rid, 0)}


def draw_drafts(
    logits: torch.Tensor, active: Sequence[Request], drafts: dict[str, list[int]], j: int
) -> None:
    """Draft ``j`` of each active request from its row of ``logits``, drawn as its target will
    be (its sampling, its noise at that output index, the penalties of the tokens before it),
    appended to ``drafts``."""
    tokens = sample(
        logits,
        [r.sampling for r in active],
        [seed_of(r.request_id, r.sampling) for r in active],
        [len(r.output_token_ids) + j for r in active],
        [
            (r.prompt_token_ids, (*r.output_token_ids, *drafts[r.request_id]))
            if r.sampling.penalized
            else None
            for r in active
        ],
    )
    for r, t in zip(active, tokens, strict=True):
        drafts[r.request_id].append(t)
