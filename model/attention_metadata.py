"""What the attention ops need to know about a ragged batch.

A step's new tokens are packed request after request::

    tokens      | r0 t0 t1 t2 | r1 t0 | r2 t0 t1 |        (T = 6 new tokens)
    query_start   0             3       4          6
    prefix_lens   p0            p1      p2                (tokens already in the pool)
    seq_lens      p0+3          p1+1    p2+2

Request ``i`` owns pages ``page_table[i, :ceil(seq_lens[i] / page_size)]``; token ``j`` of the
pool for that request lives at ``page_table[i, j // page_size] * page_size + j % page_size``.
Rows with one new token go through absorbed (latent-space) decode attention; the others
through plain extend attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    page_size: int
    query_lens: list[int]  # new tokens per request
    seq_lens: list[int]  # prefix + new tokens per request
    query_start: torch.Tensor  # [B+1] int64, cumulative query_lens
    seq_lens_t: torch.Tensor  # [B] int64
    page_table: torch.Tensor  # [B, max_pages] int64, padded with 0
    slot_mapping: torch.Tensor  # [T] int64, pool slot of each new token
    decode_rows: list[int]  # requests with one new token
    extend_rows: list[int]  # requests with several new tokens
    # a bound on seq_lens known before the step (a static-shape step's max_model_len): kernels
    # size their grids by it instead of by this batch, so one captured graph fits every step
    max_seq_len: int | None = None
    # rows -> (their metadata, their tokens' indices in the batch): a mixed step's two parts,
    # built from the host's lists before the forward, read by every layer
    _parts: dict[tuple[int, ...], tuple[AttentionMetadata, torch.Tensor]] = field(
        default_factory=dict, repr=False, compare=False
    )

    @property
    def num_tokens(self) -> int:
        return sum(self.query_lens)

    def rows(self, rows: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
        """The metadata of some requests and the indices of their tokens in the batch: the whole
        batch as it is, or a part computed once from the host's lists (never from a device tensor:
        a layer asking for it launches without waiting for the device)."""
        key = tuple(rows)
        part = self._parts.get(key)
        if part is None:
            if len(rows) == len(self.query_lens):
                part = (self, torch.arange(self.num_tokens, device=self.slot_mapping.device))
            else:
                part = self._part(rows)
            self._parts[key] = part
        return part

    def _part(self, rows: list[int]) -> tuple[AttentionMetadata, torch.Tensor]:
        index = torch.tensor(self._token_index(rows), dtype=torch.int64, device=self.slot_mapping.device)
        return self.subset(rows), index

    def _token_index(self, rows: list[int]) -> list[int]:
        starts = [0, *_cumsum(self.query_lens)]
        return [t for r in rows for t in range(starts[r], starts[r + 1])]

    def subset(self, rows: list[int]) -> AttentionMetadata:
        """The metadata of some requests only (their tokens re-packed), from the host's lists."""
        q = [self.query_lens[r] for r in rows]
        s = [self.seq_lens[r] for r in rows]
        device = self.page_table.device
        index = torch.tensor(rows, dtype=torch.int64, device=device)
        token_index = self._token_index(rows)
        return AttentionMetadata(
            page_size=self.page_size,
            query_lens=q,
            seq_lens=s,
            query_start=torch.tensor([0, *_cumsum(q)], dtype=torch.int64, device=device),
            seq_lens_t=torch.tensor(s, dtype=torch.int64, device=device),
            page_table=self.page_table.index_select(0, index),
            slot_mapping=self.slot_mapping[torch.tensor(token_index, dtype=torch.int64, device=device)],
            decode_rows=[i for i, n in enumerate(q) if n == 1],
            extend_rows=[i for i, n in enumerate(q) if n != 1],
        )

    @staticmethod
    def build(
        page_size: int,
        query_lens: list[int],
        seq_lens: list[int],
        page_ids: list[list[int]],
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        max_pages = max((len(p) for p in page_ids), default=0) or 1
        table = torch.zeros((len(page_ids), max_pages), dtype=torch.int64)
        slots: list[int] = []
        for i, (pages, n, s) in enumerate(zip(page_ids, query_lens, seq_lens, strict=True)):
            if -(-s // page_size) > len(pages):
                raise ValueError(f"request {i}: {s} tokens need more than its {len(pages)} pages")
            table[i, : len(pages)] = torch.tensor(pages, dtype=torch.int64)
            slots.extend(pages[j // page_size] * page_size + j % page_size for j in range(s - n, s))
        meta = AttentionMetadata(
            page_size=page_size,
            query_lens=list(query_lens),
            seq_lens=list(seq_lens),
            query_start=torch.tensor([0, *_cumsum(query_lens)], dtype=torch.int64, device=device),
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            page_table=table.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            decode_rows=[i for i, n in enumerate(query_lens) if n == 1],
            extend_rows=[i for i, n in enumerate(query_lens) if n != 1],
        )
        for part in (meta.extend_rows, meta.decode_rows):  # a mixed step's parts, before the launch
            if part:
                meta.rows(part)
        return meta


def _cumsum(values: list[int]) -> list[int]:
    out, total = [], 0
    for v in values:
        total += v
        out.append(total)
    return out
