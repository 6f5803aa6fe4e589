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

In a DEP group every rank must run the same bucket in the same step (its MoE layers exchange
fixed-capacity buffers sized by it, ``engine/dep.py``): before the launch, the ranks agree on the
largest batch among them (one all-reduce of one number); a rank with fewer rows, or none, pads to
that bucket. A rank whose step is not a decode batch (a prefill chunk, a step with prompt
logprobs) or past the largest bucket makes the whole group's step eager.

On a GPU each bucket's forward is captured at start (``capture_all``, every rank of a group
together, largest bucket first so the smaller ones share its memory pool) as a CUDA graph over
static input buffers, and replayed with the step's values copied in: nothing in it syncs with the
host (metadata from the host's lists, fixed-capacity exchanges, the attention's split count from
``max_seq_len``). Capture uses the thread-local mode, so a CUDA call another thread makes at the
time (NIXL's progress thread, the transport's event watcher) neither breaks the capture nor is
captured. On a CPU the same padded inputs run the model eagerly; a stand-in recorder
(:class:`RerunRecorder`) exercises capture and replay over the static buffers, and what only a GPU
can confirm is that CUDA's capture and replay give those tokens too.
"""

from __future__ import annotations

import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tandem.engine.dep import ExpertParallelDispatcher
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


class Recording(ABC):
    """One captured forward: ``replay()`` reruns it over the static buffers it was captured on,
    leaving its result in ``output``."""

    output: torch.Tensor

    @abstractmethod
    def replay(self) -> None: ...


class GraphRecorder(ABC):
    @abstractmethod
    def record(self, device: torch.device, forward: Callable[[], torch.Tensor]) -> Recording:
        """Capture ``forward`` (which reads only static buffers) for replay."""


class _CudaRecording(Recording):
    def __init__(self, graph: torch.cuda.CUDAGraph, output: torch.Tensor) -> None:
        self.graph, self.output = graph, output

    def replay(self) -> None:
        self.graph.replay()


class CudaGraphRecorder(GraphRecorder):
    """CUDA graphs: the forward warmed twice on a side stream (Triton compiles there, the
    collectives' communicators are set up), then captured in the thread-local mode."""

    def __init__(self) -> None:
        self.pool: Any = None  # the memory pool the recordings share, once the first has made it

    def record(self, device: torch.device, forward: Callable[[], torch.Tensor]) -> Recording:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            output = forward()
        self.pool = graph.pool()
        return _CudaRecording(graph, output)


class _Rerun(Recording):
    def __init__(self, forward: Callable[[], torch.Tensor]) -> None:
        self.forward, self.output = forward, forward()

    def replay(self) -> None:
        with torch.inference_mode():  # the forward's output is an inference tensor
            self.output.copy_(self.forward())


class RerunRecorder(GraphRecorder):
    """The CPU stand-in: "capture" runs the forward once over the static buffers, "replay" runs
    it again over whatever they hold then and writes the result into the same output tensor, as
    a graph's replay does. A step that forgot to copy an input into its buffer replays stale
    values here as on a GPU."""

    def record(self, device: torch.device, forward: Callable[[], torch.Tensor]) -> Recording:
        return _Rerun(forward)


@dataclass
class _Graph:
    recording: Recording
    ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata


class StaticDecode:
    """``run(plan, size)``: the hidden states of a decode batch's rows, computed at bucket
    ``size`` (``step_bucket`` agrees on it). ``recorder``: capture and replay each bucket's
    forward (CUDA graphs by default on a CUDA model; ``graphs=False``: eager at static shapes)."""

    def __init__(
        self,
        model: DeepseekV3,
        pool: KVPool,
        max_batch: int,
        max_model_len: int,
        buckets: tuple[int, ...] | None = None,
        graphs: bool | None = None,
        recorder: GraphRecorder | None = None,
    ) -> None:
        self.model, self.pool = model, pool
        self.buckets = tuple(sorted(buckets or default_buckets(max_batch)))
        if not self.buckets or self.buckets[0] < 1:
            raise ValueError(f"buckets must be positive batch sizes, got {buckets}")
        self.max_model_len = max_model_len
        self.max_pages = -(-max_model_len // pool.page_size)
        if graphs is None:
            graphs = recorder is not None or model.device.type == "cuda"
        if graphs and recorder is None:
            if model.device.type != "cuda":
                raise ValueError("CUDA graphs need a model on a CUDA device")
            recorder = CudaGraphRecorder()
        self.recorder = recorder if graphs else None
        dispatcher = model.dispatcher
        # a DEP group of several ranks: they agree on each step's bucket, and exchange
        # fixed-capacity buffers in it
        self.group: ExpertParallelDispatcher | None = None
        if isinstance(dispatcher, ExpertParallelDispatcher) and dispatcher.world_size > 1:
            self.group = dispatcher
        self._captured: dict[int, _Graph] = {}
        self.padded_rows = 0  # padding rows computed since start (the price of static shapes)

    @property
    def graphs(self) -> bool:
        return self.recorder is not None

    @property
    def captured(self) -> tuple[int, ...]:
        return tuple(sorted(self._captured))

    def bucket(self, batch: int) -> int | None:
        """The smallest bucket that holds ``batch`` rows; None past the largest."""
        return next((b for b in self.buckets if b >= batch), None)

    def applies(self, plan: SchedulerOutput) -> bool:
        return is_decode_batch(plan) and self.bucket(decode_rows(plan)) is not None

    def step_bucket(self, plan: SchedulerOutput, eligible: bool = True) -> int | None:
        """The bucket this step runs at, or None for an eager step. Alone: the plan's own. In a
        DEP group every rank calls this every step, before its launch: the group's largest batch
        decides, and any rank's step that is not a static decode batch (``eligible`` False, a
        plan that is not a decode batch) makes the group's step eager."""
        static = eligible and (is_decode_batch(plan) or (self.group is not None and not plan.chunks))
        rows = decode_rows(plan) if static else self.buckets[-1] + 1  # past every bucket: eager
        if self.group is not None:
            agreed = torch.tensor([rows], dtype=torch.int64, device=self.model.device)
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=self.group.group)
            rows = int(agreed.item())  # before the launch: the step's one agreement
        return self.bucket(rows) if static and rows <= self.buckets[-1] else None

    def inputs(
        self, plan: SchedulerOutput, size: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """The step's padded inputs, each of bucket ``size``'s shape (by default the plan's own
        bucket; a verify chunk: a row a position)."""
        batch = decode_rows(plan)
        size = size or self.bucket(batch)
        if size is None or size < batch:
            raise ValueError(f"a decode batch of {batch} is past the bucket {size or self.buckets[-1]}")
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

    def run(
        self,
        plan: SchedulerOutput,
        size: int | None = None,
        launch_guard: Callable[[], contextlib.AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> torch.Tensor:
        """The hidden states ``[rows, hidden]`` of the batch's rows, a row a position, computed at
        bucket ``size`` (by default the plan's own). ``launch_guard`` wraps the launch alone (the
        forward or the replay), after the inputs are on the device."""
        ids, positions, meta = self.inputs(plan, size)
        batch = decode_rows(plan)
        size = ids.shape[0]
        self.padded_rows += size - batch
        if self.recorder is None:
            with self._capacity(size), launch_guard():
                return self.model.forward(ids, positions, meta, self.pool)[:batch]
        graph = self._captured.get(size) or self._capture(size)
        graph.ids.copy_(ids)
        graph.positions.copy_(positions)
        graph.meta.seq_lens_t.copy_(meta.seq_lens_t)
        graph.meta.page_table.copy_(meta.page_table)
        graph.meta.slot_mapping.copy_(meta.slot_mapping)
        graph.meta.seq_lens = meta.seq_lens
        with launch_guard():
            graph.recording.replay()
        return graph.recording.output[:batch]

    def capture_all(self) -> tuple[int, ...]:
        """Capture every bucket now, largest first (a rank's start: every rank of a group calls
        this together, since the captures run the group's collectives)."""
        if self.recorder is not None:
            for size in sorted(self.buckets, reverse=True):
                if size not in self._captured:
                    self._capture(size)
        return self.captured

    def _capacity(self, size: int) -> contextlib.AbstractContextManager[None]:
        return self.group.fixed_capacity(size) if self.group is not None else contextlib.nullcontext()

    def _capture(self, size: int) -> _Graph:
        """Static buffers of bucket ``size`` (all padding: the capture writes no slot), and
        their forward recorded."""
        assert self.recorder is not None
        ids, positions, meta = self.inputs(SchedulerOutput((), 0, ()), size)
        model, pool = self.model, self.pool

        def forward() -> torch.Tensor:
            with self._capacity(size):
                return model.forward(ids, positions, meta, pool)

        captured = _Graph(self.recorder.record(model.device, forward), ids, positions, meta)
        self._captured[size] = captured
        return captured


def static_decode_enabled(device_type: str) -> bool:
    """Whether a rank's decode batches run at static shapes: ``TANDEM_STATIC_DECODE=1`` or ``0``
    decides; by default on a GPU, whatever the group's size (a group's decode steps exchange
    fixed-capacity buffers), and never on a CPU, where padding rows only cost time."""
    choice = os.environ.get("TANDEM_STATIC_DECODE", "")
    if choice not in ("", "0", "1"):
        raise ValueError(f"TANDEM_STATIC_DECODE: expected 0 or 1, got {choice!r}")
    if choice:
        return choice == "1"
    return device_type == "cuda"
