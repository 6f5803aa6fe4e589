"""What a transfer writes, as regions of registered memory: each kind of a pool's pages, and a
rank's slots of per-request state (DeepSeek-V4's window and open windows,
``model/v4/state_slots.py``).

A region holds some of the model's layers (``layers``), each as ``num_entries`` entries (pages,
or slots) ``entry_stride_bytes`` apart; entry ``e`` of its ``i``-th layer starts at
``base_address + layer_offsets[i] + e * entry_stride_bytes`` and is ``layer_bytes[i]`` long (a
slot's layers differ in size: an HCA layer's open window is larger than a sliding-window
layer's nothing). A transfer of model layer ``l`` writes, in every region that holds ``l``, the
request's entries: its pages in a page region, its slot in a slot region::

    V3                      region "kv": layers 0..60, pages                   (one region)
    V4 (tiny: CSA HCA SWA CSA)
                            region "compressed.4":  layers 0, 3    pages
                            region "compressed.16": layer 1        pages
                            region "indexer_keys":  layers 0, 3    pages
                            region "state":         layers 0..3    slots (per-layer sizes)

One prepared descriptor list covers every (region, layer, entry), region after region, each
region layer-major: entry ``start[r] + i * num_entries + e``. Torch-free."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tandem.kvtransfer.descriptors import PageRun, page_runs


@dataclass(frozen=True)
class Region:
    name: str
    base_address: int
    layers: tuple[int, ...]
    num_entries: int
    entry_stride_bytes: int
    layer_offsets: tuple[int, ...]
    layer_bytes: tuple[int, ...]
    slots: bool = False  # entries are requests' slots, not pages
    dtype: str = ""

    def address(self, index: int, entry: int) -> int:
        return self.base_address + self.layer_offsets[index] + entry * self.entry_stride_bytes

    @property
    def extent(self) -> int:
        """Bytes from the base to the end of the furthest entry."""
        last = self.num_entries - 1
        return max(
            off + last * self.entry_stride_bytes + n
            for off, n in zip(self.layer_offsets, self.layer_bytes, strict=True)
        )


@dataclass(frozen=True)
class TransferLayout:
    regions: tuple[Region, ...]
    num_layers: int  # the model layers a transfer goes through, 0 .. num_layers - 1
    page_size: int
    mem_type: str = "DRAM"
    device_id: int = 0

    @property
    def has_slots(self) -> bool:
        return any(region.slots for region in self.regions)

    def region(self, name: str) -> Region:
        return next(r for r in self.regions if r.name == name)

    def compatible_with(self, other: TransferLayout) -> str | None:
        """Why a transfer between the two is impossible, or ``None``: the same regions, each
        with the same layers of the same bytes (the entries' counts may differ)."""
        if (self.num_layers, self.page_size) != (other.num_layers, other.page_size):
            return (
                f"layers and page size differ: {self.num_layers} and {self.page_size} here, "
                f"{other.num_layers} and {other.page_size} there"
            )
        mine = {r.name: r for r in self.regions}
        theirs = {r.name: r for r in other.regions}
        if mine.keys() != theirs.keys():
            return f"kinds differ: {sorted(mine)} here, {sorted(theirs)} there"
        for name, region in mine.items():
            there = theirs[name]
            for field in ("layers", "layer_bytes", "slots", "dtype"):
                here_value, there_value = getattr(region, field), getattr(there, field)
                if here_value != there_value:
                    return f"{name}: {field} differs: {here_value} here, {there_value} there"
        return None

    def starts(self) -> list[int]:
        """Each region's first entry in the prepared list."""
        out, at = [], 0
        for region in self.regions:
            out.append(at)
            at += len(region.layers) * region.num_entries
        return out

    def descs(self) -> list[tuple[int, int, int]]:
        """One ``(address, length, device)`` per (region, layer, entry), in the prepared order."""
        return [
            (region.address(i, entry), region.layer_bytes[i], self.device_id)
            for region in self.regions
            for i in range(len(region.layers))
            for entry in range(region.num_entries)
        ]

    def registrations(self) -> list[tuple[int, int, int, str]]:
        """The memory to register: each region from its base to its extent."""
        return [(region.base_address, region.extent, self.device_id, "") for region in self.regions]

    def runs(
        self, src_pages: Sequence[int], dst_pages: Sequence[int], src_slot: int | None, dst_slot: int | None
    ) -> dict[str, list[PageRun]]:
        """Each region's runs of entries a request's transfer writes: its pages in a page
        region, its slot in a slot region (``ValueError`` when a slot is not given for one)."""
        if self.has_slots and (src_slot is None or dst_slot is None):
            raise ValueError("this pool's transfers write a slot of state: none was given")
        pages = page_runs(src_pages, dst_pages)
        slot = [PageRun(src_slot, dst_slot, 1)] if src_slot is not None and dst_slot is not None else []
        return {region.name: slot if region.slots else pages for region in self.regions}

    def indices(
        self, runs: Mapping[str, Sequence[PageRun]], layers: Sequence[int], peer: TransferLayout
    ) -> tuple[list[int], list[int], int]:
        """The prepared entries (here and in ``peer``'s list) a write of ``layers`` covers, each
        region's ``runs`` of entries, and the bytes they hold."""
        src: list[int] = []
        dst: list[int] = []
        nbytes = 0
        peer_starts = dict(zip((r.name for r in peer.regions), peer.starts(), strict=True))
        peer_entries = {r.name: r.num_entries for r in peer.regions}
        for region, start in zip(self.regions, self.starts(), strict=True):
            ours, theirs = region.num_entries, peer_entries[region.name]
            for layer in layers:
                if layer not in region.layers:
                    continue
                i = region.layers.index(layer)
                for run in runs.get(region.name, ()):
                    src.extend(start + i * ours + run.src_page + k for k in range(run.pages))
                    dst.extend(
                        peer_starts[region.name] + i * theirs + run.dst_page + k for k in range(run.pages)
                    )
                    nbytes += run.pages * region.layer_bytes[i]
        return src, dst, nbytes


def one_region(
    name: str,
    base_address: int,
    num_layers: int,
    num_pages: int,
    layer_stride_bytes: int,
    page_stride_bytes: int,
    page_bytes: int,
    dtype: str,
) -> Region:
    """A kind of pages laid out ``[layers, pages, page]``: every layer its own pages."""
    return Region(
        name,
        base_address,
        tuple(range(num_layers)),
        num_pages,
        page_stride_bytes,
        tuple(layer * layer_stride_bytes for layer in range(num_layers)),
        (page_bytes,) * num_layers,
        dtype=dtype,
    )
