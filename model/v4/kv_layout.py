"""What a DeepSeek-V4 rank keeps of a request, by kind of state, and its bytes (torch-free).

Every layer keeps its **window** (the sliding window's K = V, ``head_dim`` numbers a token; a
request needs only the pages its last ``sliding_window`` tokens lie on, the older ones are
freed or kept as prefix-cache pages). CSA and HCA layers keep their **compressed** entries
(``head_dim`` numbers per ``rate`` tokens); CSA layers the **indexer's keys** (``index_head_dim``
per ``rate`` tokens) and the **overlap** of a page: its last window's ``Ca`` projections (gate
and KV, for the compressor and the indexer) from which the next page's first entry is computed,
float32 as the compressor computes them. While a request runs, each compressor holds
its **open window**: the projections of the tokens of a window not complete yet (at most
``rate - 1`` tokens, float32), and on CSA layers the last complete window's ``Ca`` projections
the next entry gates over.

Pages are sized so that a page boundary is a compression boundary of every layer (the page
size a multiple of every rate): a page's compressed entries, indexer keys and overlap belong to
it alone, so a prefix of whole pages restores exactly the state computing it would leave (the
open windows are empty there). The compressed kinds grow with the request (``page_bytes``); the
window and the open windows are bounded per request (``request_bytes``). What only a prefix-cache
hit reads (a page's window KV and overlap) is kept for a share of the pages (``window_share``,
in slots: ``engine/window_slots.py``), so hits land on those pages' boundaries."""

from __future__ import annotations

import math
from dataclasses import dataclass

from tandem.model.page_kinds import FLOAT32_BYTES, PageKind, pool_bytes
from tandem.model.v4.config import CSA, V4Config

# the share of pages whose window KV and overlap a prefix cache keeps (hits land on their
# boundaries): on V4-Flash those are 44,032 + 3,360 B a token against 6,880 B for the entries
WINDOW_SHARE = 0.25


@dataclass(frozen=True)
class KindBytes:
    """One kind of state of every layer that keeps it: bytes per token of a request's length
    (``per_token``, for the kinds that grow with it) or per request (``per_request``)."""

    kind: str
    layers: int
    per_token: float
    per_request: int


def v4_page_size(cfg: V4Config, page_size: int) -> int:
    """Tokens a V4 page holds for a pool of ``page_size``: a multiple of every compression rate."""
    return math.lcm(page_size, *cfg.compress_rates)


def pages_for_bytes(
    cfg: V4Config,
    page_size: int,
    item_bytes: int,
    budget: int,
    max_seqs: int,
    prefix_caching: bool = False,
    window_share: float = WINDOW_SHARE,
) -> int:
    """Pages of ``page_size`` tokens (a multiple of every rate) that ``budget`` bytes hold beside
    ``max_seqs`` running requests' windows and open windows; ``prefix_caching``: with slots for
    the window KV and overlap of ``window_share`` of the pages (what a prefix cache restores a
    hit's state from). The pool of that many pages
    (:func:`v4_page_kinds`) holds at most the rest of ``budget``."""
    kinds = v4_kinds(cfg, item_bytes, page_size, prefix_caching, window_share)
    per_page = page_bytes(kinds, page_size)
    free = budget - max_seqs * request_bytes(kinds)
    on_pages = v4_page_kinds(cfg, page_size, prefix_caching, window_share)
    pages = free // per_page
    while pages > 0 and pool_bytes(on_pages, pages, item_bytes) > free:  # slots round up
        pages -= 1
    if pages <= 0:
        raise ValueError(
            f"kv_pool_bytes {budget}: below {max_seqs} requests' windows and open windows "
            f"({max_seqs * request_bytes(kinds)} bytes) and one page"
        )
    return pages


def check_page_size(cfg: V4Config, page_size: int) -> None:
    bad = [rate for rate in cfg.compress_rates if page_size % rate]
    if bad:
        raise ValueError(f"page_size {page_size} is not a multiple of the compression rates {bad}")


def window_pages(cfg: V4Config, page_size: int) -> int:
    """Pages a request's window spans at most: its last ``sliding_window`` tokens (the query's
    own among them), wherever they start in a page."""
    return math.ceil((cfg.sliding_window - 1) / page_size) + 1


def window_reach(cfg: V4Config, page_size: int) -> int:
    """Pages before a boundary a hit there restores from beyond their entries: the last one's
    overlap, the window KV of those the window reaches into."""
    return max(math.ceil((cfg.sliding_window - 1) / page_size), 1)


def v4_page_kinds(
    cfg: V4Config, page_size: int, prefix_caching: bool = True, window_share: float = WINDOW_SHARE
) -> list[PageKind]:
    """What a V4 page keeps, by kind (``model/page_kinds.py``): the ``compressed.R`` entries of
    the layers of rate ``R`` (``page_size / R`` a page) and CSA layers' ``indexer_keys``, which
    running requests attend to from their pages; with ``prefix_caching``, what only a hit reads:
    every layer's ``window`` KV of the page's tokens and CSA layers' ``overlap``, the page's last
    window's ``Ca`` projections, ``rate`` rows of ``[kv | gate | indexer kv | indexer gate]``
    (float32, as the compressors compute them), both in slots for ``window_share`` of the pages
    (``engine/window_slots.py``)."""
    check_page_size(cfg, page_size)
    n = cfg.num_hidden_layers
    hd, ihd = cfg.head_dim, cfg.index_head_dim
    if not 0 < window_share <= 1:
        raise ValueError(f"window_share must be in (0, 1], got {window_share}")
    kinds = (
        [PageKind("window", tuple(range(n)), page_size, hd, share=window_share, in_slots=True)]
        if prefix_caching
        else []
    )
    for rate in sorted({cfg.compress_rate(i) for i in range(n)} - {0}):
        layers = tuple(i for i in range(n) if cfg.compress_rate(i) == rate)
        kinds.append(PageKind(f"compressed.{rate}", layers, page_size // rate, hd))
    csa = tuple(i for i in range(n) if cfg.layer_types[i] == CSA)
    if csa:
        r = cfg.compress_rate_csa
        kinds.append(PageKind("indexer_keys", csa, page_size // r, ihd))
        if prefix_caching:
            kinds.append(
                PageKind("overlap", csa, r, 2 * (hd + ihd), float32=True, share=window_share, in_slots=True)
            )
    return kinds


def v4_kinds(
    cfg: V4Config,
    item_bytes: int,
    page_size: int,
    prefix_caching: bool = False,
    window_share: float = WINDOW_SHARE,
) -> list[KindBytes]:
    """Each kind's bytes, in a model of ``item_bytes`` a number; ``prefix_caching``: with the
    ``overlap`` and the ``page_window`` kinds, ``window_share`` of the pages keeping their last
    window's overlap and their tokens' window KV (what a prefix cache restores a hit's state
    from), beside the running requests' own windows. The kinds on pages are
    :func:`v4_page_kinds`' (the pool's tensors)."""
    n = cfg.num_hidden_layers
    hd, ihd = cfg.head_dim, cfg.index_head_dim
    on_pages = {kind.name: kind for kind in v4_page_kinds(cfg, page_size, prefix_caching, window_share)}

    def paged(name: str, *names: str) -> KindBytes:
        found = [on_pages[k] for k in names if k in on_pages]
        per_token = sum(k.page_bytes(item_bytes) * k.share for k in found) / page_size
        return KindBytes(name, sum(len(k.layers) for k in found), per_token, 0)

    compressed = [i for i in range(n) if cfg.compress_rate(i)]
    kinds = [
        KindBytes("window", n, 0.0, n * window_pages(cfg, page_size) * page_size * hd * item_bytes),
        paged("compressed", *(k for k in on_pages if k.startswith("compressed."))),
        paged("indexer_keys", "indexer_keys"),
    ]
    if prefix_caching:
        kinds.append(paged("overlap", "overlap"))
    open_window = 0
    for i in compressed:  # (rate - 1) tokens' gate and KV projections, the indexer's too on CSA
        rate = cfg.compress_rate(i)
        width = 2 * hd + 2 * ihd if cfg.layer_types[i] == CSA else hd
        open_window += (rate - 1) * 2 * width * FLOAT32_BYTES
        if cfg.layer_types[i] == CSA:  # and the last complete window's Ca (gate and KV), both
            open_window += rate * 2 * (hd + ihd) * FLOAT32_BYTES
    kinds.append(KindBytes("open_window", len(compressed), 0.0, open_window))
    if prefix_caching:
        kinds.append(paged("page_window", "window"))
    return kinds


def page_bytes(kinds: list[KindBytes], page_size: int) -> int:
    """One page of the kinds that grow with a request, every layer (a whole number of bytes:
    each kind's page is)."""
    return round(sum(k.per_token for k in kinds) * page_size)


def request_bytes(kinds: list[KindBytes]) -> int:
    """What a running request holds beside its pages: its window and its open windows."""
    return sum(k.per_request for k in kinds)


_ALIGN = 16  # every field of a state slot starts on 16 bytes, so its bytes view as its dtype


@dataclass(frozen=True)
class StateField:
    """One field of a request's bounded state in a slot (``model/v4/state_slots.py``)."""

    name: str
    offset: int  # bytes into the slot
    rows: int
    width: int
    item_bytes: int
    float32: bool = False

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * (FLOAT32_BYTES if self.float32 else self.item_bytes)

    @property
    def end(self) -> int:
        """Where the next field starts."""
        return self.offset + -(-self.nbytes // _ALIGN) * _ALIGN


def state_fields(cfg: V4Config, item_bytes: int, mtp: bool = False) -> list[list[StateField]]:
    """Each layer's fields of a slot, layer after layer: its window's last ``sliding_window -
    1`` tokens' KV (model dtype), and on compressed layers the compressor's open window (KV and
    gate projections of at most ``rate - 1`` tokens) and on CSA layers its last window's ``Ca``
    (``rate`` rows), the indexer's likewise (float32). With ``mtp``, the MTP layer's after them
    (layer ``num_hidden_layers``: a sliding window only)."""
    hd, ihd = cfg.head_dim, cfg.index_head_dim
    layers, offset = [], 0
    for layer in range(cfg.num_hidden_layers + int(mtp)):
        shapes: list[tuple[str, int, int, bool]] = [("window", cfg.sliding_window - 1, hd, False)]
        rate = cfg.compress_rate(layer)
        if rate:
            csa = cfg.layer_types[layer] == CSA
            width = 2 * hd if csa else hd
            shapes += [("kv", rate - 1, width, True), ("gate", rate - 1, width, True)]
            if csa:
                shapes += [("overlap_kv", rate, hd, True), ("overlap_gate", rate, hd, True)]
                shapes += [("index_kv", rate - 1, 2 * ihd, True), ("index_gate", rate - 1, 2 * ihd, True)]
                shapes += [("index_overlap_kv", rate, ihd, True), ("index_overlap_gate", rate, ihd, True)]
        fields = []
        for name, rows, width, f32 in shapes:
            field = StateField(name, offset, rows, width, item_bytes, f32)
            fields.append(field)
            offset = field.end
        layers.append(fields)
    return layers


def slot_bytes(cfg: V4Config, item_bytes: int, mtp: bool = False) -> int:
    """One request's state slot: every layer's fields (with ``mtp``, the MTP layer's too), what
    its transfer writes beside its pages."""
    return state_fields(cfg, item_bytes, mtp)[-1][-1].end


def transfer_slots(prefill: bool, max_num_seqs: int) -> int:
    """State slots a disaggregated rank keeps for the transfers in flight: a decode rank one per
    request it may hold, a prefill rank two (a step's finishing requests may start sending while
    the last step's still are)."""
    return (2 if prefill else 1) * max_num_seqs
