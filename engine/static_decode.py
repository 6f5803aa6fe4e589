"""Decode steps of static shape, for CUDA graphs.

A step whose every chunk is one new token of a request (the decode batch), or a verify step
(each request's last token and its drafts, every position sampled: a row a position, row ``j``
over the request's positions up to its own), runs padded to the smallest bucket of rows that
holds it, with every input of a bucket's fixed shape:

    input_ids, positions, seq_lens_t, slot_mapping   [bucket]
    page_table                                       [bucket, max_model_len / page_size]
    query_start                                      [bucket + 1]  (0, 1, .., bucket)
    max_seq_len                                      max_model_len (sizes the attention grid)

A padding row is token 0 at position 0 over one token of page 0, and its slot is -1: the KV
store writes nothing for it, and its output row is dropped before sampling. Rows are independent
in attention, routing and the experts, so the real rows' values are those of the unpadded batch.

On a GPU each bucket's forward is captured once as a CUDA graph over static input buffers and
replayed with the step's values copied in (nothing in it syncs with the host: the expert exchange
of a group of one is local, and the attention's split count comes from ``max_seq_len``). On a CPU
the same padded inputs run the model eagerly: tests check that path gives the eager path's tokens,
and what only a GPU can confirm is that capture and replay give them too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine.scheduler_output import SchedulerOutput
from tandem.model.attention_metadata import AttentionMetadata
from tandem.model.deepseek import DeepseekV3
from tandem.model.kv_pool import KVPool

PADDING_SLOT = -1


def default_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 8 up to 64 and every 32 beyond, the last one ``max_batch``."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be at least 1, got {max_batch}")
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(96, max_batch + 1, 32)]
    return tuple(sorted({s for s in sizes if s < max_batch} | {max_batch}))


def is_decode_batch(plan: SchedulerOutput) -> bool:
    """Every chunk is one token of a request that samples its next token, or a verify chunk (its
    last token and drafts, each position sampled): each position one decode row."""
    return bool(plan.chunks) and all(c.sample and c.num_sampled == len(c.token_ids) for c in plan.chunks)


def decode_rows(plan: SchedulerOutput) -> int:
    return sum(len(c.token_ids) for c in plan.chunks)


@dataclass
class _Graph:
    graph: Any  # torch.cuda.CUDAGraph
    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    hidden: torch.Tensor


class StaticDecode:
    """``run(plan)``: the hidden states of a decode batch's rows, computed at its bucket's shape.
    ``graphs``: capture and replay CUDA graphs (a CUDA model only)."""

    def __init__(
        self,
        model: DeepseekV3,
        pool: KVPool,
        max_batch: int,
        max_model_len: int,
        buckets: tuple[int, ...] | None = None,
        graphs: bool | None = None,
    ) -> None:
        self.model, self.pool = model, pool
        self.buckets = tuple(sorted(buckets or default_buckets(max_batch)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        self.max_model_len = max_model_len
        self.max_pages = -(-max_model_len // pool.page_size)
        self.graphs = model.device.type == "cuda" if graphs is None else graphs
        if self.graphs and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a model on a CUDA device")
        self._captured: dict[int, _Graph] = {}
        self.padded_rows = 0  # padding rows computed since start (the price of static shapes)

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket that holds ``batch`` rows; None past the largest."""
        return next((b for b in self.buckets if b >= batch), None)

    def applies(self, plan: SchedulerOutput) -> bool:
        return is_decode_batch(plan) and self.bucket(decode_rows(plan)) is not None

    def inputs(self, plan: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's padded inputs, each of its bucket's shape (a verify chunk: a row a position)."""
        batch = decode_rows(plan)
        size = self.bucket(batch)
        if size is None:
            raise ValueError(f"a decode batch of {batch} is past the largest bucket {self.buckets[-1]}")
        page_size, pad = self.pool.page_size, size - batch
        table = torch.zeros((size, self.max_pages), dtype=torch.int64)
        ids: list[int] = []
        positions: list[int] = []
        seq_lens: list[int] = []
        slots: list[int] = []
        for c in plan.chunks:
            pages = list(c.page_ids)
            last = c.start_position + len(c.token_ids) - 1
            if len(pages) > self.max_pages or -(-(last + 1) // page_size) > len(pages):
                raise ValueError(f"request {c.request_id}: its pages do not fit a static step")
            row_pages = torch.tensor(pages, dtype=torch.int64)
            for j, token in enumerate(c.token_ids):
                position = c.start_position + j
                table[len(ids), : len(pages)] = row_pages
                ids.append(token)
                positions.append(position)
                seq_lens.append(position + 1)
                slots.append(pages[position // page_size] * page_size + position % page_size)
        ids += [0] * pad
        positions += [0] * pad
        seq_lens += [1] * pad
        slots += [PADDING_SLOT] * pad
        device = self.model.device
        meta = AttentionMetadata(
            page_size=page_size,
            query_lens=[1] * size,
            seq_lens=seq_lens,
            query_start=torch.arange(size + 1, dtype=torch.int64, device=device),
            seq_lens_t=torch.tensor(seq_lens, dtype=torch.int64, device=device),
            page_table=table.to(device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            decode_rows=list(range(size)),
            extend_rows=[],
            max_seq_len=self.max_model_len,
        )
        as_tensor = torch.tensor
        return as_tensor(ids, device=device), as_tensor(positions, device=device), meta

    def run(self, plan: SchedulerOutput) -> torch.Tensor:
        """The hidden states ``[rows, hidden]`` of the batch's rows, a row a position."""
        ids, positions, meta = self.inputs(plan)
        batch = decode_rows(plan)
        self.padded_rows += ids.shape[0] - batch
        if not self.graphs:
            return self.model.forward(ids, positions, meta, self.pool)[:batch]
        graph = self._captured.get(ids.shape[0]) or self._capture(ids, positions, meta)
        graph.ids.copy_(ids)
        graph.positions.copy_(positions)
        graph.meta.seq_lens_t.copy_(meta.seq_lens_t)
        graph.meta.page_table.copy_(meta.page_table)
        graph.meta.slot_mapping.copy_(meta.slot_mapping)
        graph.meta.seq_lens = meta.seq_lens
        graph.graph.replay()
        return graph.hidden[:batch]

    def _capture(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> _Graph:
        """Warm the bucket's kernels on a side stream (Triton compiles there), then capture."""
        model, pool = self.model, self.pool
        static_ids, static_positions = ids.clone(), positions.clone()
        static_meta = AttentionMetadata(
            page_size=meta.page_size,
            query_lens=list(meta.query_lens),
            seq_lens=list(meta.seq_lens),
            query_start=meta.query_start.clone(),
            seq_lens_t=meta.seq_lens_t.clone(),
            page_table=meta.page_table.clone(),
            slot_mapping=torch.full_like(meta.slot_mapping, PADDING_SLOT),  # capture writes nothing
            decode_rows=list(meta.decode_rows),
            extend_rows=[],
            max_seq_len=meta.max_seq_len,
        )
        stream = torch.cuda.Stream(model.device)
        stream.wait_stream(torch.cuda.current_stream(model.device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                model.forward(static_ids, static_positions, static_meta, pool)
        torch.cuda.current_stream(model.device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            hidden = model.forward(static_ids, static_positions, static_meta, pool)
        captured = _Graph(graph, static_ids, static_positions, static_meta, hidden)
        self._captured[ids.shape[0]] = captured
        return captured


def static_decode_enabled(device_type: str, world_size: int) -> bool:
    """Whether a rank's decode batches run at static shapes: ``TANDEM_STATIC_DECODE=1`` or ``0``
    decides; by default on a GPU in a group of one (a larger group's expert exchange sizes its
    messages on the host, which a graph cannot hold), and never on a CPU, where padding rows
    only cost time."""
    choice = os.environ.get("TANDEM_STATIC_DECODE", "")
    if choice not in ("", "0", "1"):
        raise ValueError(f"TANDEM_STATIC_DECODE: expected 0 or 1, got {choice!r}")
    if choice:
        return choice == "1"
    return device_type == "cuda" and world_size == 1
