"""Slots of DeepSeek-V4 requests' bounded state, laid out for a transfer layer by layer.

A request's compressed entries and indexer keys are in its pages (``model/v4/pages.py``); the
rest of its state is bounded whatever its length (``kv_layout.request_bytes``), per layer:

    window        its last ``sliding_window - 1`` tokens' KV               model dtype
    kv, gate      on CSA and HCA layers, the compressor's open window:     float32
                  the projections of the tokens of the window not complete
                  yet (``position % rate`` of them, at most ``rate - 1``)
    overlap_kv,   on CSA layers, the last complete window's ``Ca``          float32
    overlap_gate  (``rate`` rows), once a window is complete
    index_*       on CSA layers, the same four for the indexer's compressor

One slot holds one request's, every layer's fields at fixed offsets, each layer's fields one
span of bytes (``spans``): a prefill rank packs layer ``l``'s state into its slot as soon as the
layer has run (``write``) and a transfer writes that span into the decode rank's slot; the
decode rank rebuilds the state from its slot (``read``) and its pages, exactly the state
computing the tokens leaves (``tests/model/v4/test_v4_state_slots.py``), and goes on from there:
its first steps complete the windows the prefill left open. The slots are one ``uint8`` tensor
``[slots, slot_bytes]``, registered whole with a transport."""

from __future__ import annotations

import torch

from tandem.kvtransfer.regions import Region
from tandem.model.v4.attention import LayerState
from tandem.model.v4.compressor import CompressorState
from tandem.model.v4.config import CSA, V4Config
from tandem.model.v4.kv_layout import StateField, slot_bytes, state_fields


class StateSlots:
    def __init__(
        self,
        cfg: V4Config,
        slots: int,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        mtp: bool = False,
    ) -> None:
        """``mtp``: a layer more, the MTP layer's (its window), which a transfer sends last."""
        self.cfg, self.dtype = cfg, dtype
        item = torch.empty((), dtype=dtype).element_size()
        self.fields: list[list[StateField]] = state_fields(cfg, item, mtp)
        self.slot_bytes = slot_bytes(cfg, item, mtp)
        self.data = torch.zeros(slots, self.slot_bytes, dtype=torch.uint8, device=device)

    @property
    def num_slots(self) -> int:
        return self.data.shape[0]

    @property
    def num_layers(self) -> int:
        """The layers of a slot: the model's, and the MTP layer's when it has one."""
        return len(self.fields)

    def spans(self) -> list[tuple[int, int]]:
        """Each layer's ``(offset, bytes)`` in a slot: what a transfer of that layer writes."""
        return [(f[0].offset, f[-1].offset + f[-1].nbytes - f[0].offset) for f in self.fields]

    def region(self) -> Region:
        """The slots as a transfer region (``kvtransfer/regions.py``): a layer of a slot is its
        span."""
        spans = self.spans()
        return Region(
            "state",
            self.data.data_ptr(),
            tuple(range(len(spans))),
            self.num_slots,
            self.slot_bytes,
            tuple(offset for offset, _ in spans),
            tuple(size for _, size in spans),
            slots=True,
            dtype=str(self.dtype).removeprefix("torch."),
        )

    def _view(self, slot: int, field: StateField) -> torch.Tensor:
        raw = self.data[slot, field.offset : field.offset + field.nbytes]
        return raw.view(torch.float32 if field.float32 else self.dtype).view(field.rows, field.width)

    def write(self, slot: int, layer: int, state: LayerState, position: int) -> None:
        """Layer ``layer``'s state after ``position`` tokens into ``slot``."""
        views = {f.name: self._view(slot, f) for f in self.fields[layer]}
        window = state.window
        rows = min(position, self.cfg.sliding_window - 1)
        if rows:
            assert window is not None and window.shape[0] == rows, "a window of the wrong length"
            views["window"][:rows] = window
        rate = self.cfg.compress_rate(layer)
        if not rate:
            return
        parts = [("", state.compressor)]
        if self.cfg.layer_types[layer] == CSA:
            parts.append(("index_", state.indexer))
        for prefix, compressor in parts:
            _check_count(compressor, position, rate)
            open_rows = position % rate
            if open_rows:
                assert compressor.buffer_kv is not None and compressor.buffer_gate is not None
                views[prefix + "kv"][:open_rows] = compressor.buffer_kv
                views[prefix + "gate"][:open_rows] = compressor.buffer_gate
            if prefix + "overlap_kv" in views and position >= rate:
                assert compressor.overlap_kv is not None and compressor.overlap_gate is not None
                views[prefix + "overlap_kv"].copy_(compressor.overlap_kv)
                views[prefix + "overlap_gate"].copy_(compressor.overlap_gate)

    def read(self, slot: int, layer: int, position: int) -> LayerState:
        """The state ``write`` left in ``slot`` for ``position`` tokens (copies: the slot may be
        written again at once); its entries are the request's pages' (``pages.bind_pages``)."""
        views = {f.name: self._view(slot, f) for f in self.fields[layer]}
        rows = min(position, self.cfg.sliding_window - 1)
        state = LayerState(window=views["window"][:rows].clone() if position else None)
        rate = self.cfg.compress_rate(layer)
        if not rate:
            return state
        state.compressor = self._compressor(views, "", position, rate)
        if self.cfg.layer_types[layer] == CSA:
            state.indexer = self._compressor(views, "index_", position, rate)
        return state

    @staticmethod
    def _compressor(views: dict[str, torch.Tensor], prefix: str, position: int, rate: int) -> CompressorState:
        open_rows = position % rate
        compressor = CompressorState(count=position // rate)
        if position:
            compressor.buffer_kv = views[prefix + "kv"][:open_rows].clone()
            compressor.buffer_gate = views[prefix + "gate"][:open_rows].clone()
        if prefix + "overlap_kv" in views and position >= rate:
            compressor.overlap_kv = views[prefix + "overlap_kv"].clone()
            compressor.overlap_gate = views[prefix + "overlap_gate"].clone()
        return compressor


def _check_count(compressor: CompressorState, position: int, rate: int) -> None:
    if compressor.count != position // rate:
        raise ValueError(f"a compressor with {compressor.count} entries at position {position} (rate {rate})")
