"""What a DeepSeek-V4 runner holds of one request from one step to the next (``engine/v4_runner.py``)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.model.v4.attention import LayerState


@dataclass
class Held:
    position: int  # the tokens this state has seen
    layers: list[LayerState]
    # a prefill rank's that drafts with MTP: the MTP layer's state, its rows' positions so far
    # (each row reads the token after it, so it lags), and where its window starts: past a prefix
    # hit, whose pages keep no MTP state, the window starts cold at the hit; None once it cannot
    # go on (rows missing before a chunk)
    mtp: LayerState | None = None
    mtp_position: int = 0
    mtp_start: int = 0
