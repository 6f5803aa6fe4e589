"""The compressor of a CSA or HCA layer (and of CSA's indexer): every ``rate`` source tokens of
a request become one compressed entry, a softmax-gated sum of their projected KV, normed, then
rotated at the window's first position (the ``compress`` rope).

With ``overlap`` (CSA and its indexer) each token projects to two series of ``dim`` numbers:
``Ca`` (the first half, its part in the *next* window's entry) and ``Cb`` (the second half, its
part in its own window's entry); entry ``w`` gates over window ``w - 1``'s ``Ca`` and window
``w``'s ``Cb``, ``2 * rate`` slots (window 0 has no previous one: its ``Ca`` slots weigh 0).
Without it (HCA) entry ``w`` gates over window ``w``'s ``rate`` tokens.

A request's :class:`CompressorState` is what makes this independent of how its tokens are split
into forward calls: the projections of the tokens of the window not yet complete (``buffer``),
the previous window's ``Ca`` projections (``overlap``) and the entries so far. Entry ``w`` is
visible to the query at position ``p`` once its window is complete: ``w < (p + 1) // rate``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.model.v4.rope import rotate_tail

if TYPE_CHECKING:
    from tandem.model.kernels.backend import KernelBackend


@dataclass
class CompressorState:
    """One request's compressor state for one layer (float32 projections, entries in the
    model's dtype)."""

    buffer_kv: torch.Tensor | None = None  # [b < rate, width]
    buffer_gate: torch.Tensor | None = None
    overlap_kv: torch.Tensor | None = None  # [rate, dim]: the last complete window's Ca
    overlap_gate: torch.Tensor | None = None
    entries: torch.Tensor | None = None  # [E, dim]: a view of ``storage``'s first rows
    count: int = 0  # entries so far
    # the rows ``entries`` views, with room to grow: appending copies the new entries only (the
    # capacity doubles when full), where concatenating would copy all of them every window
    storage: torch.Tensor | None = None
    # with ``page_size`` set (a prefix cache keeps pages): each window that ends on a page
    # boundary leaves its ``Ca`` projections here, by the boundary's position, until taken
    page_size: int = 0
    boundary_overlaps: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def append(self, new: torch.Tensor) -> None:
        """``entries`` followed by ``new [n, dim]``."""
        have = 0 if self.entries is None else self.entries.shape[0]
        need = have + new.shape[0]
        if self.storage is None or self.storage.shape[0] < need or self.storage.dtype != new.dtype:
            capacity = max(need, 2 * (0 if self.storage is None else self.storage.shape[0]), 16)
            grown = new.new_empty(capacity, new.shape[1])
            if self.entries is not None and have:
                grown[:have] = self.entries
            self.storage = grown
        self.storage[have:need] = new
        self.entries = self.storage[:need]


class Compressor(nn.Module):
    """``wkv, wgate [width, D]`` (``width = 2 * dim`` with overlap), ``ape [rate, width]`` (the
    positional gate bias) and ``norm [dim]``, all float32 as the model's own code keeps them."""

    def __init__(
        self, hidden: int, dim: int, rate: int, overlap: bool, eps: float, device: torch.device | str
    ) -> None:
        super().__init__()
        self.dim, self.rate, self.overlap, self.eps = dim, rate, overlap, eps
        width = 2 * dim if overlap else dim
        self.wkv = nn.Parameter(torch.empty(width, hidden, device=device), requires_grad=False)
        self.wgate = nn.Parameter(torch.empty(width, hidden, device=device), requires_grad=False)
        self.ape = nn.Parameter(torch.empty(rate, width, device=device), requires_grad=False)
        self.norm = nn.Parameter(torch.empty(dim, device=device), requires_grad=False)

    def forward(
        self,
        state: CompressorState,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        dtype: torch.dtype,
        ops: KernelBackend,
    ) -> torch.Tensor:
        """Take a request's next tokens ``x [n, D]``; its entries so far ``[E, dim]``.
        ``cos, sin`` are the compress rope's whole tables (entries rotate at their window's
        first position); ``ops`` pools the complete windows (``compress_windows``)."""
        kv = x.float() @ self.wkv.t()
        gate = x.float() @ self.wgate.t()
        if state.buffer_kv is not None:
            assert state.buffer_gate is not None
            kv, gate = torch.cat([state.buffer_kv, kv]), torch.cat([state.buffer_gate, gate])
        usable = kv.shape[0] // self.rate * self.rate
        state.buffer_kv, state.buffer_gate = kv[usable:], gate[usable:]
        if usable:
            windows = usable // self.rate
            kv, gate = kv[:usable].view(windows, self.rate, -1), gate[:usable].view(windows, self.rate, -1)
            new = ops.compress_windows(
                kv, gate, self.ape, self.norm, self.eps, self.overlap, state.overlap_kv, state.overlap_gate
            )
            if self.overlap:
                self._keep_overlaps(state, kv, gate)
            positions = torch.arange(windows, device=x.device) * self.rate + state.count * self.rate
            new = rotate_tail(new.to(dtype), cos[positions], sin[positions])
            state.append(new)
            state.count += windows
        if state.entries is None:
            state.entries = torch.empty(0, self.dim, dtype=dtype, device=x.device)
        return state.entries

    def _keep_overlaps(self, state: CompressorState, kv: torch.Tensor, gate: torch.Tensor) -> None:
        """The last complete window's ``Ca`` (KV, and gate with its ``ape``) for the next
        window's entry; with pages kept, also each window's ending on a page boundary."""
        d, r = self.dim, self.rate

        def ca(j: int) -> tuple[torch.Tensor, torch.Tensor]:
            return kv[j, :, :d].clone(), gate[j, :, :d] + self.ape[:, :d]

        state.overlap_kv, state.overlap_gate = ca(kv.shape[0] - 1)
        if state.page_size:
            per_page = state.page_size // r
            first = -(state.count + 1) % per_page  # the first new window ending on a boundary
            for j in range(first, kv.shape[0], per_page):
                state.boundary_overlaps[(state.count + j + 1) * r] = ca(j)
