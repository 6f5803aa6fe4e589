"""Drafts from DeepSeek-V4's multi-token-prediction layer (``model/v4/mtp.py``), run K times
chained, as V3's (``engine/mtp_drafter.py``) but over V4's state:

    pass 1   rows p = q-m .. q-1 of each request (the positions whose next token became known
             since its last pass), each reading the main model's residual streams at p (all
             ``hc_mult`` of them, kept by the runner: ``V4Runner.hidden_rows``) and the token at
             p+1. The request's MTP state (its sliding window) moves on past them: those tokens
             are known. After its KV arrived, m = 1 from the prefill rank's streams at the
             prompt's last position, and the state is the one the prefill rank packed into the
             request's slot (``V4Runner.take_mtp_state``).
    pass j   one row per request with room > j, at q+j-1: draft j-1 and the MTP block's own
             output streams of the previous pass. These rows are speculative: a V4 state is not
             written over in place, so the state is kept as it was after pass 1 and put back
             after the last pass.

Drafts are drawn as the target draws its tokens (``draw_drafts``). Every step runs the layer
exactly K times, on empty batches too: its MoE block exchanges rows with the DEP group's other
ranks, which must run it as often. A request whose prefill sent no MTP state drafts nothing; one
whose prefill started at a prefix hit drafts from a window started cold there
(``engine/v4_mtp_rows.py``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch

from tandem.engine.drafter import Drafter
from tandem.engine.mtp_drafter import draw_drafts
from tandem.engine.v4_mtp_rows import unpack_draft_state
from tandem.model.v4.pages import snapshot

if TYPE_CHECKING:
    from tandem.engine.request import Request
    from tandem.engine.speculation import SpeculativeConfig
    from tandem.engine.v4_runner import V4Runner
    from tandem.model.v4.attention import LayerState
    from tandem.model.v4.model import DeepseekV4


class V4MtpDrafter(Drafter):
    needs_weights = True
    needs_hidden = True

    def __init__(self, config: SpeculativeConfig, *, model: DeepseekV4, runner: V4Runner, **_: Any) -> None:
        if model.mtp is None:
            raise ValueError("drafter mtp: the model was loaded without its MTP layer")
        self.k = config.num_tokens
        self.model, self.runner = model, runner
        # request -> the main model's streams [m, hc_mult, D] of its next pass-1 rows
        self._pending: dict[str, torch.Tensor] = {}
        self._states: dict[str, LayerState] = {}  # request -> its MTP state, at position q - m

    def start(self, request_id: str, hidden: Any = None) -> None:
        state = self.runner.take_mtp_state(request_id)
        cfg = self.model.cfg
        sent = (
            unpack_draft_state(hidden, (cfg.hc_mult, cfg.hidden_size)) if isinstance(hidden, bytes) else None
        )
        if state is None or sent is None:
            return  # none sent: this request drafts nothing
        streams, rows = sent
        # a window started cold at a prefix hit holds fewer rows than its position: the slot's first
        keep = min(rows, cfg.sliding_window - 1)
        state.window = state.window[:keep] if keep and state.window is not None else None
        self._pending[request_id] = streams.to(self.model.device, self.model.dtype)
        self._states[request_id] = state

    def observe(self, request_id: str, accepted: Sequence[int], hidden: Any = None) -> None:
        if isinstance(hidden, torch.Tensor) and request_id in self._states:
            self._pending[request_id] = hidden[: len(accepted)].clone()

    def forget(self, request_id: str) -> None:
        self._pending.pop(request_id, None)
        self._states.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, requests: Sequence[Request], k: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        model, device, cfg = self.model, self.model.device, self.model.cfg
        rows = [r for r in requests if r.request_id in self._pending]
        streams: list[torch.Tensor] = []
        ids: list[int] = []
        positions: list[int] = []
        lens: list[int] = []
        for r in rows:  # pass 1: every pending row of every request, in one ragged batch
            s = self._pending.pop(r.request_id)
            m, q = s.shape[0], r.num_tokens - 1
            ids.extend(r.all_token_ids[q - m + 1 : q + 1])
            positions.extend(range(q - m, q))
            streams.append(s)
            lens.append(m)
        states = [self._states[r.request_id] for r in rows]
        empty = torch.empty((0, cfg.hc_mult, cfg.hidden_size), dtype=model.dtype, device=device)
        hidden, out = model.draft(
            torch.cat(streams) if streams else empty,
            torch.tensor(ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            lens,
            states,
        )
        last = torch.tensor(
            [sum(lens[: i + 1]) - 1 for i in range(len(rows))], dtype=torch.int64, device=device
        )
        hidden, out = hidden[last], out[last]
        kept = dict(zip([r.request_id for r in rows], snapshot(states), strict=True))  # after pass 1
        drafts: dict[str, list[int]] = {r.request_id: [] for r in rows}
        active = rows
        for j in range(self.k):
            if j:  # a chained pass at each request's position q + j - 1, on states put back after
                hidden, out = model.draft(
                    out,
                    torch.tensor(
                        [drafts[r.request_id][-1] for r in active], dtype=torch.int64, device=device
                    ),
                    torch.tensor([r.num_tokens - 2 + j for r in active], dtype=torch.int64, device=device),
                    [1] * len(active),
                    [self._states[r.request_id] for r in active],
                )
            if active:
                draw_drafts(model.compute_logits(hidden), active, drafts, j)
            keep = [i for i, r in enumerate(active) if k.get(r.request_id, 0) > j + 1]
            active = [active[i] for i in keep]
            index = torch.tensor(keep, dtype=torch.int64, device=device)
            hidden, out = hidden[index], out[index]
        self._states.update(kept)
        return {rid: tuple(d[: k.get(rid, 0)]) for rid, d in drafts.items() if k.get(rid, 0)}
