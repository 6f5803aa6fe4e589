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

On a serving rank the entries live in the rank's KV pool (:class:`PagedRows`: the request's
pages of the layer's kind, ``page_size / rate`` entries a page, written as they are made and
read from there); a state with no pages bound keeps them in tensors of its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from tandem.model.v4.rope import rotate_tail

if TYPE_CHECKING:
    from tandem.model.kernels.backend import KernelBackend


@dataclass(frozen=True)
class PagedRows:
    """A request's entries in one layer's pages of one kind of the KV pool: ``table [pages,
    per_page, dim]`` and the request's page ids from its first token (entry ``e`` is row ``e %
    per_page`` of page ``page_ids[e // per_page]``)."""

    table: torch.Tensor
    page_ids: tuple[int, ...]

    def _rows(self, first: int, count: int) -> torch.Tensor:
        """The flat table rows of entries ``first .. first + count`` (computed on the host)."""
        per = self.table.shape[1]
        entries = torch.arange(first, first + count)
        pages = torch.tensor(self.page_ids[first // per : -(-(first + count) // per)], dtype=torch.int64)
        return (pages[entries // per - first // per] * per + entries % per).to(self.table.device)

    def write(self, first: int, new: torch.Tensor) -> None:
        """Entries ``first ..`` (``new [n, dim]``) into their pages."""
        self.table.view(-1, self.table.shape[2]).index_copy_(0, self._rows(first, new.shape[0]), new)

    def read(self, count: int) -> torch.Tensor:
        """The first ``count`` entries, ``[count, dim]`` (a copy, gathered from the pages)."""
        per, dim = self.table.shape[1], self.table.shape[2]
        pages = self.page_ids[: -(-count // per)]
        ids = torch.tensor(pages, dtype=torch.int64).to(self.table.device)
        return self.table[ids].reshape(-1, dim)[:count]


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
    pages: PagedRows | None = None  # where the entries live on a serving rank (then not ``entries``)
    # the rows ``entries`` views, with room to grow: appending copies the new entries only (the
    # capacity doubles when full), where concatenating would copy all of them every window
    storage: torch.Tensor | None = None
    # with ``page_size`` set (a prefix cache keeps pages): each window that ends on a page
    # boundary leaves its ``Ca`` projections here, by the boundary's position, until taken
    page_size: int = 0
    boundary_overlaps: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)

    def so_far(self, dim: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The entries so far, ``[count, dim]``."""
        if self.pages is not None:
            return self.pages.read(self.count)
        if self.entries is None:
            return torch.empty(0, dim, dtype=dtype, device=device)
        return self.entries

    def append(self, new: torch.Tensor) -> None:
        """The entries so far followed by ``new [n, dim]`` (before ``count`` moves on)."""
        if self.pages is not None:
            self.pages.write(self.count, new)
            return
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
        # copies: views would keep every new token's projections alive until the next call
        state.buffer_kv, state.buffer_gate = kv[usable:].clone(), gate[usable:].clone()
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
        return state.so_far(self.dim, dtype, x.device)

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
