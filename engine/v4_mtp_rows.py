"""What a DeepSeek-V4 runner does for MTP drafts.

A prefill rank's part (``V4Runner(mtp_prefill=True)``): the MTP layer (``model/v4/mtp.py``) over
each chunk's positions whose next token is known, as V3's (``ModelRunner._mtp_rows``): row ``p``
reads the main model's residual streams at ``p`` and the token at ``p + 1`` (the chunk's next,
then ``next_token_id``). A prompt's last position waits for the decode rank, which knows its
next token; the request's MTP state, its rows so far, crosses in its slot as the last layer.
A prefix hit's pages keep no MTP state (only the model's layers'), so a request whose prefill
starts at a hit starts its MTP window cold there: the layer's attention sees the rows from the
hit on (fewer than its window until it fills). Its drafts are the layer's from that window,
which the target verifies as any: the tokens do not change, only how many drafts are accepted.
The row count crosses with the streams in the notification's ``draft_state``.

A decode rank's part (``keep_hidden``): the sampled rows' streams, which its drafter reads
(``engine/v4_mtp_drafter.py``), and the MTP states read from the arriving requests' slots."""

from __future__ import annotations

import struct
from collections.abc import Callable

import numpy as np
import torch

from tandem.engine.scheduler_output import ScheduledChunk
from tandem.engine.v4_held import Held
from tandem.model.v4.attention import LayerState
from tandem.model.v4.model import DeepseekV4
from tandem.model.v4.state_slots import StateSlots


class MtpRows:
    """What a V4 runner keeps for MTP drafts: on a prefill rank, which finishing requests' MTP
    states went into their slots this step, with their windows' rows (``ready``); on a decode
    rank, the last step's sampled rows' streams (``streams``) and the MTP states read from
    arriving requests' slots until their drafter takes them (``adopted``)."""

    def __init__(self, model: DeepseekV4) -> None:
        self.model = model
        self.streams: torch.Tensor | None = None
        self.ready: dict[str, int] = {}
        self.adopted: dict[str, LayerState] = {}

    def new_step(self) -> None:
        self.streams, self.ready = None, {}

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
            rows = h.mtp_position - h.mtp_start  # a window layer's slot holds its last rows
            slots.write(slot, layer, h.mtp, rows)
            self.ready[chunk.request_id] = rows
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


def pack_draft_state(streams: torch.Tensor, rows: int) -> bytes:
    """A V4 request's ``draft_state``: the main model's streams at its prompt's last position
    (float32, ``hc_mult x hidden_size``), then its MTP window's rows (int64, little-endian)."""
    return streams.float().cpu().numpy().tobytes() + struct.pack("<q", rows)


def unpack_draft_state(data: bytes, shape: tuple[int, int]) -> tuple[torch.Tensor, int] | None:
    """``pack_draft_state``'s streams ``[1, *shape]`` and rows; ``None`` for anything else (no
    state sent)."""
    size = 4 * shape[0] * shape[1]
    if len(data) != size + 8:
        return None
    streams = torch.from_numpy(np.frombuffer(data[:size], dtype=np.float32).copy()).view(1, *shape)
    return streams, struct.unpack("<q", data[size:])[0]
