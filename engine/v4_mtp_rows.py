"""What a DeepSeek-V4 runner does for MTP drafts.

A prefill rank's part (``V4Runner(mtp_prefill=True)``): the MTP layer (``model/v4/mtp.py``) over
each chunk's positions whose next token is known, as V3's (``ModelRunner._mtp_rows``): row ``p``
reads the main model's residual streams at ``p`` and the token at ``p + 1`` (the chunk's next,
then ``next_token_id``). A prompt's last position waits for the decode rank, which knows its
next token; the request's MTP state, its rows so far, crosses in its slot as the last layer. A
request whose rows cannot go on from where its state is (its chunk started from a prefix hit,
which keeps no MTP state) has none from then on, and its decode rank drafts nothing for it.

A decode rank's part (``keep_hidden``): the sampled rows' streams, which its drafter reads
(``engine/v4_mtp_drafter.py``), and the MTP states read from the arriving requests' slots."""

from __future__ import annotations

from collections.abc import Callable

import torch

from tandem.engine.scheduler_output import ScheduledChunk
from tandem.engine.v4_held import Held
from tandem.model.v4.attention import LayerState
from tandem.model.v4.model import DeepseekV4
from tandem.model.v4.state_slots import StateSlots


class MtpRows:
    """What a V4 runner keeps for MTP drafts: on a prefill rank, which finishing requests' MTP
    states went into their slots this step (``ready``); on a decode rank, the last step's sampled
    rows' streams (``streams``) and the MTP states read from arriving requests' slots until their
    drafter takes them (``adopted``)."""

    def __init__(self, model: DeepseekV4) -> None:
        self.model = model
        self.streams: torch.Tensor | None = None
        self.ready: set[str] = set()
        self.adopted: dict[str, LayerState] = {}

    def new_step(self) -> None:
        self.streams, self.ready = None, set()

    def adopt(self, request_id: str, slots: StateSlots, slot: int, position: int) -> None:
        """The MTP state in ``slot`` of a request taken on at ``position``, if the slots have the
        MTP layer: its rows lag a token (the last needs the first output)."""
        layer = self.model.cfg.num_hidden_layers
        if slots.num_layers > layer:
            self.adopted[request_id] = slots.read(slot, layer, position - 1)

    def export(
        self,
        chunks: list[ScheduledChunk],
        held: list[Held],
        exports: dict[str, int],
        slots: StateSlots | None,
        on_layer: Callable[[int], None] | None,
    ) -> None:
        """Each finishing request's MTP state (all its rows up to its prompt's last position) into
        its slot as the slot's last layer; then ``on_layer`` of that layer (a transfer sends it)."""
        layer = self.model.cfg.num_hidden_layers
        for chunk, h in zip(chunks, held, strict=True):
            slot = exports.get(chunk.request_id)
            if slot is None or slots is None or h.mtp is None or h.mtp_position != h.position - 1:
                continue
            slots.write(slot, layer, h.mtp, h.mtp_position)
            self.ready.add(chunk.request_id)
        if on_layer is not None:
            on_layer(layer)

    def advance(
        self, chunks: list[ScheduledChunk], held: list[Held], offsets: list[int], streams: torch.Tensor
    ) -> None:
        """Each chunk's MTP rows through the layer in one ragged batch (``offsets``: each chunk's
        first row in ``streams``), each request's MTP state moving on past them. In a DEP group
        every rank runs it once a step (its MoE exchanges rows), on an empty batch too."""
        model = self.model
        device = model.device
        take: list[int] = []  # rows of the packed batch that get an MTP row
        next_ids: list[int] = []
        positions: list[int] = []
        counts: list[int] = []
        states: list[LayerState] = []
        for chunk, h, at in zip(chunks, held, offsets, strict=True):
            following = [
                *chunk.token_ids[1:],
                *([] if chunk.next_token_id is None else [chunk.next_token_id]),
            ]
            if h.mtp is not None and h.mtp_position != chunk.start_position:
                h.mtp = None  # rows missing before this chunk: its MTP state cannot go on
            if h.mtp is None or not following:
                continue
            take.extend(range(at, at + len(following)))
            next_ids.extend(following)
            positions.extend(range(chunk.start_position, chunk.start_position + len(following)))
            counts.append(len(following))
            states.append(h.mtp)
            h.mtp_position += len(following)
        model.draft(
            streams[torch.tensor(take, dtype=torch.int64, device=device)],
            torch.tensor(next_ids, dtype=torch.int64, device=device),
            torch.tensor(positions, dtype=torch.int64, device=device),
            counts,
            states,
        )
