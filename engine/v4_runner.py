"""DeepSeek-V4's runner: a plan's chunks through :class:`~tandem.model.v4.model.DeepseekV4` as
one mixed step (prefill chunks and decode rows together), each request's state held here from
one step to the next: per layer its sliding window's KV, its compressed entries and indexer
keys, and its compressors' open windows and overlap (``model/v4/attention.LayerState``).

A chunk continues its request's state where the last one ended, so the request's tokens are the
same whatever the chunking (``--prefill-chunk-tokens``) and the batch. A chunk at position 0
starts a fresh state: a new request, or one preempted (its state dropped with its pages) and
recomputed.

A request's compressed entries and indexer keys live in its pages of the rank's KV pool (the
``pool`` given; ``model/v4/pages.bind_pages``), written as they are made and read from there.
With ``prefix_caching``, every page a request completes gets the rest of its state too (the
page's window KV and its last window's overlap): a chunk that starts at a prefix-cache hit (a
page boundary past 0 with no state of its own) gets its state rebuilt from its first pages,
exactly the state computing them leaves. A page is restorable from its completion until it is
filled again or its request rejects the drafts that completed it; the window KV is kept for
some pages only (``engine/window_slots.py``), so the prefix cache cuts a hit down to a boundary
whose window is kept (``hit_pages``). A chunk that
finds neither is refused, naming the request, rather than run on a wrong state. A step whose
forward fails drops its requests' states (they moved part of the way). A request's state goes
with it (``forget``)."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping

import torch

from tandem.engine.dep import any_rank_has_work
from tandem.engine.sampling_runner import SamplingRunner
from tandem.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from tandem.engine.v4_held import Held
from tandem.engine.v4_mtp_rows import MtpRows, pack_draft_state
from tandem.engine.window_slots import WindowSlots
from tandem.model.grammar import GuidedRows
from tandem.model.kv_pool import KVPool
from tandem.model.v4.attention import LayerState
from tandem.model.v4.kv_layout import window_reach
from tandem.model.v4.model import DeepseekV4
from tandem.model.v4.pages import bind_pages, keep_pages, open_rows, restore, snapshot, store_pages
from tandem.model.v4.state_slots import StateSlots


class V4Runner(SamplingRunner):
    def __init__(
        self,
        model: DeepseekV4,
        lockstep: bool = False,
        guides: GuidedRows | None = None,
        guard_syncs: bool | None = None,
        pool: KVPool | None = None,
        prefix_caching: bool = False,
        state_slots: StateSlots | None = None,
        speculative: bool = False,
        mtp_prefill: bool = False,
        keep_hidden: bool = False,
    ) -> None:
        """``pool``: the rank's KV pool of V4's kinds (its pages a multiple of every compression
        rate; ``None``: each request's entries in tensors of its own, no prefix caching);
        ``prefix_caching``: completed pages keep all their state, for hits (the pool has the
        kinds for it); ``state_slots``: where a prefill rank packs a finishing request's bounded
        state for its transfer, and where a decode rank receives it (``run``'s ``exports``,
        ``adopt``); ``speculative``: its steps verify drafts (in a DEP group every step then
        agrees whether any rank computes rejected drafts' accepted tokens again: ``verify``).
        ``mtp_prefill``, ``keep_hidden``: for MTP drafts, a prefill rank's and a decode rank's
        part (``engine/v4_mtp_rows.py``)."""
        if (mtp_prefill or keep_hidden) and model.mtp is None:
            raise ValueError("MTP drafts need a model built with its MTP layer")
        super().__init__(model, lockstep, guides, guard_syncs, keep_hidden or mtp_prefill)
        self.speculative = speculative
        self.state_slots = state_slots
        self.mtp_prefill = mtp_prefill
        self.drafting = MtpRows(model)
        self._exports: dict[str, int] = {}  # this step's finishing requests -> their slots
        self._on_layer: Callable[[int], None] | None = None
        if prefix_caching and (pool is None or "window" not in pool.names):
            raise ValueError("prefix caching for DeepSeek-V4 needs a pool with the window and overlap kinds")
        self.model = model
        self.pool = pool
        self.page_size = pool.page_size if pool is not None and prefix_caching else None
        # the pages whose window KV and overlap the pool keeps, in its window slots
        self.slots = WindowSlots(0)
        if pool is not None and prefix_caching:
            share = next(kind.share for kind in pool.kinds if kind.name == "window")
            self.slots = WindowSlots.for_share(pool.tensors["window"].shape[1], share)
        self.states: dict[str, Held] = {}
        self.written: set[int] = set()  # page ids holding the whole state of the tokens that filled them
        self.restores = 0  # states rebuilt from pages (prefix-cache hits)

    def hit_pages(self, page_ids: list[int]) -> int:
        """The most leading pages of ``page_ids`` (a prefix cache's matched run) a hit may use: a
        run of written pages whose last pages' window KV is in the slots (``restore``)."""
        size = self.page_size
        if size is None:
            return 0
        return self.slots.restorable(page_ids, self.written, window_reach(self.model.cfg, size))

    def slot_of(self, page_id: int) -> int | None:
        """The window slot holding ``page_id``'s boundary state (its window KV and overlap), if
        the page is whole: what the host tier and the store keep of it (``KVTiers.boundary``)."""
        return self.slots.peek(page_id) if page_id in self.written else None

    def take(self, page_id: int, boundary: bool) -> int | None:
        """``page_id`` is loaded whole from the host tier or the store, its boundary state too
        if ``boundary``: a window slot for that (the page's own if it has one), or none (an old
        slot of the page's is given back: what it held was another page's)."""
        self.written.add(page_id)
        if boundary:
            return self.slots.take(page_id)
        self.slots.release(page_id)
        return None

    def run(
        self,
        plan: SchedulerOutput,
        on_layer_kv: Callable[[int], None] | None = None,
        exports: Mapping[str, int] | None = None,
    ) -> dict[str, int]:
        """The plan's chunks as one step, a token sampled for each chunk that asks for one.
        ``exports``: requests whose last chunk this is, each with a slot of ``state_slots``: as
        each layer runs, each one's state of that layer goes into its slot, and then
        ``on_layer_kv(layer)`` runs (the layer's pages and slots are final for this step: a
        transfer may send them)."""
        if any(c.draft_token_ids for c in plan.chunks):
            raise ValueError("a plan with drafts is verified, not run")
        if exports and self.state_slots is None:
            raise ValueError("exporting a request's state needs state slots")
        self._exports, self._on_layer = dict(exports or {}), on_layer_kv
        try:
            return {rid: tokens[0] for rid, tokens in self.verify(plan).items()}
        finally:
            self._exports, self._on_layer = {}, None

    def adopt(self, request_id: str, position: int, page_ids: tuple[int, ...], slot: int) -> None:
        """Take on a request whose first ``position`` tokens another rank computed: its entries
        are in its pages here (``page_ids``), the rest of its state in ``slot`` (written there by
        a transfer of what ``run``'s ``exports`` packed). Its next chunk goes on from
        ``position``."""
        if self.state_slots is None or self.pool is None:
            raise ValueError("adopting a request's state needs a pool and state slots")
        slots = self.state_slots
        layers = [slots.read(slot, index, position) for index in range(self.model.cfg.num_hidden_layers)]
        bind_pages(self.model.cfg, layers, self.pool, page_ids)
        self.drafting.adopt(request_id, slots, slot, position)
        if self.page_size is not None:  # the pages it completes here keep their window KV too
            for page in page_ids:  # filled by the transfer: what they kept of an earlier use is gone
                self.written.discard(page)
                self.slots.release(page)
            keep_pages(layers, self.page_size)
            for state in layers:
                state.open_page = open_rows(state, position % self.page_size)
        self.states[request_id] = Held(position, layers)

    def take_mtp_state(self, request_id: str) -> LayerState | None:
        return self.drafting.adopted.pop(request_id, None)  # read from its slot by adopt, once

    def forget(self, request_id: str) -> None:
        super().forget(request_id)
        self.states.pop(request_id, None)
        self.drafting.adopted.pop(request_id, None)

    def hidden_rows(self, request_id: str, count: int) -> torch.Tensor:
        """The main model's residual streams ``[count, hc_mult, D]`` (before the hyper-head:
        what V4's MTP layer reads) of the first ``count`` positions the last step sampled for
        ``request_id``."""
        at = self._hidden_at.get(request_id)
        if self.drafting.streams is None or at is None or count > at[1]:
            raise KeyError(f"no {count} hidden rows of {request_id} from the last step")
        return self.drafting.streams[at[0] : at[0] + count]

    def hidden_state(self, request_id: str) -> bytes:
        """What a decode rank's MTP drafter starts from beside the request's slot: the streams at
        its last position and its MTP window's rows (``pack_draft_state``); empty when its MTP
        state did not go into its slot."""
        rows = self.drafting.ready.get(request_id)
        return b"" if rows is None else pack_draft_state(self.hidden_rows(request_id, 1)[-1], rows)

    def verify(self, plan: SchedulerOutput) -> dict[str, tuple[int, ...]]:
        """The plan's chunks as one step, each sampling chunk's tokens; a verify chunk (ending
        with drafts) runs as a chunk like any other and samples at each draft
        (``engine/speculation.accept``). A V4 state cannot be rewound in place (the compressors'
        windows move on), so a verify chunk's request's state is kept as it was before the step
        (its fields: a state's tensors are replaced or appended to, never written over); when a
        draft is rejected, the state goes back to that and the accepted tokens are computed
        again (the same state as computing them alone: a request's state does not depend on how
        its tokens are split into steps), and the pages the rejected tokens completed are
        dropped. In a DEP group that second forward's MoE layers exchange rows with the other
        ranks: a ``speculative`` runner's every step (drafts or not, so that every rank of the
        group asks) agrees with the group whether any rank computes again, and then every rank
        runs that forward, on an empty batch where it has nothing to compute; a runner not
        ``speculative`` refuses drafts in a DEP group."""
        if self.lockstep and not self.speculative and any(c.draft_token_ids for c in plan.chunks):
            raise ValueError(
                "DeepSeek-V4 drafts in a DEP group need a speculative runner: a rejected draft's "
                "recompute is a forward the whole group makes"
            )
        if not plan.chunks and not self.lockstep:
            return {}
        start = time.perf_counter()
        self._hidden, self._hidden_at = None, {}
        self.drafting.new_step()
        self.logprobs, self.prompt_logprobs = {}, {}
        for rid in plan.preempted_request_ids:  # their pages are gone: so is their state
            self.states.pop(rid, None)
        held = [self._state(c) for c in plan.chunks]
        before = {
            c.request_id: (h.position, snapshot(h.layers))
            for c, h in zip(plan.chunks, held, strict=True)
            if c.draft_token_ids
        }
        device = self.model.device
        sample_rows: list[int] = []
        offsets: list[int] = []
        at = 0
        for chunk in plan.chunks:
            offsets.append(at)
            at += len(chunk.token_ids)
            if chunk.sample:
                sample_rows.extend(range(at - chunk.num_sampled, at))
        prompt_rows = any(c.prompt_logprob_targets for c in plan.chunks)

        def forward(_: SchedulerOutput) -> torch.Tensor:
            streams = self._advance(list(plan.chunks), held, [len(c.token_ids) for c in plan.chunks])
            if self.mtp_prefill:  # the MTP layer's rows, its state into the finishing requests' slots
                self.drafting.advance(list(plan.chunks), held, offsets, streams)
                self.drafting.export(list(plan.chunks), held, self._exports, self.state_slots, self._on_layer)
            hidden = self.model.head_hidden(streams)
            if prompt_rows:
                self._prompt_logprobs(plan, offsets, hidden)
            rows = torch.tensor(sample_rows, dtype=torch.int64, device=device)
            if self.keep_hidden:
                self.drafting.streams = streams[rows]
            return hidden[rows]

        sampled = self._sample(plan, forward, start)
        if before or (self.lockstep and self.speculative):
            self._roll_back(plan, held, before, sampled)
        return sampled

    def _advance(self, chunks: list[ScheduledChunk], held: list[Held], counts: list[int]) -> torch.Tensor:
        """The first ``counts[i]`` tokens of each chunk through the model, each request's state
        moving on past them (and the pages they complete kept); their residual streams."""
        device = self.model.device
        ids = torch.tensor(
            [t for c, n in zip(chunks, counts, strict=True) for t in c.token_ids[:n]],
            dtype=torch.int64,
            device=device,
        )
        positions = [
            p
            for c, n in zip(chunks, counts, strict=True)
            for p in range(c.start_position, c.start_position + n)
        ]
        pos = torch.tensor(positions, dtype=torch.int64, device=device)
        self._bind(chunks, held, counts)
        after_layer = self._after_layer(chunks, held, counts) if self._exports or self._on_layer else None
        try:
            with self._guarded():
                streams = self.model.forward(
                    ids, pos, counts, [h.layers for h in held], before_head=True, after_layer=after_layer
                )
        except BaseException:
            for chunk in chunks:  # part-moved states: a later chunk is refused, not misrun
                self.states.pop(chunk.request_id, None)
            raise
        for h, n, chunk in zip(held, counts, chunks, strict=True):
            self._keep_pages(h, h.position + n, chunk.page_ids)
            h.position += n
        return streams

    def _after_layer(
        self, chunks: list[ScheduledChunk], held: list[Held], counts: list[int]
    ) -> Callable[[int], None]:
        """What runs after each layer: the exported requests' state of it into their slots,
        then the step's ``on_layer_kv``."""
        slots, on_layer = self.state_slots, self._on_layer
        exported = [
            (self._exports[c.request_id], h, h.position + n)
            for c, h, n in zip(chunks, held, counts, strict=True)
            if c.request_id in self._exports
        ]

        def after(layer: int) -> None:
            for slot, h, end in exported:
                assert slots is not None
                slots.write(slot, layer, h.layers[layer], end)
            if on_layer is not None:
                on_layer(layer)

        return after

    def _bind(self, chunks: list[ScheduledChunk], held: list[Held], counts: list[int]) -> None:
        """Each request's entries into its pages (as many as this step reaches); the pages it
        fills in this step are no longer restorable as what filled them before."""
        if self.pool is None:
            return
        size = self.pool.page_size
        for chunk, h, n in zip(chunks, held, counts, strict=True):
            bind_pages(self.model.cfg, h.layers, self.pool, chunk.page_ids)
            for page in chunk.page_ids[h.position // size : -(-(h.position + n) // size)]:
                self.written.discard(page)
                self.slots.release(page)

    def _roll_back(
        self,
        plan: SchedulerOutput,
        held: list[Held],
        before: dict[str, tuple[int, list[LayerState]]],
        sampled: dict[str, tuple[int, ...]],
    ) -> None:
        """Each verify chunk whose drafts were not all accepted: its state as before the step,
        then its accepted tokens computed again (one forward for all of them)."""
        again: list[tuple[ScheduledChunk, Held, int]] = []
        for chunk, h in zip(plan.chunks, held, strict=True):
            if chunk.request_id not in before:
                continue
            accepted = len(sampled[chunk.request_id]) - 1
            keep = len(chunk.token_ids) - len(chunk.draft_token_ids) + accepted
            if keep == len(chunk.token_ids):
                continue
            h.position, h.layers = before[chunk.request_id]
            self._drop_pages(chunk, h.position + keep, h.position + len(chunk.token_ids))
            again.append((chunk, h, keep))
        if self._group_agrees(bool(again)):
            self._advance([c for c, _, _ in again], [h for _, h, _ in again], [n for _, _, n in again])

    def _group_agrees(self, again: bool) -> bool:
        """Whether this step computes accepted tokens again: on one rank, if it has any; in a DEP
        group of a ``speculative`` runner, if any rank of the group has (one collective)."""
        if not (self.lockstep and self.speculative):
            return again
        if not torch.distributed.is_initialized():  # a group of one, outside a deployment
            return again
        group = getattr(self.model.dispatcher, "group", None)  # None: the default group
        return any_rank_has_work(again, group, self.model.device)

    def _drop_pages(self, chunk: ScheduledChunk, end: int, computed: int) -> None:
        """Forget the pages completed by the chunk's tokens past ``end`` (rejected drafts)."""
        size = self.page_size
        if size is None:
            return
        for boundary in range((end // size + 1) * size, computed + 1, size):
            self.written.discard(chunk.page_ids[boundary // size - 1])
            self.slots.release(chunk.page_ids[boundary // size - 1])

    def _state(self, chunk: ScheduledChunk) -> Held:
        rid, start = chunk.request_id, chunk.start_position
        held = self.states.get(rid)
        if held is not None and held.position == start:
            return held
        if start == 0:
            layers = self.model.new_state()
            if self.page_size is not None:
                keep_pages(layers, self.page_size)
            held = self.states[rid] = Held(0, layers, LayerState() if self.mtp_prefill else None)
            return held
        restored = self._restore(chunk)
        if restored is None:
            at = "none" if held is None else f"position {held.position}"
            raise ValueError(
                f"request {rid}: a DeepSeek-V4 chunk at position {start}, its state at {at} "
                "and no pages to rebuild it from"
            )
        self.restores += 1
        cold = LayerState() if self.mtp_prefill else None  # the hit's pages keep no MTP state
        held = self.states[rid] = Held(start, restored, cold, start, start)
        return held

    def _restore(self, chunk: ScheduledChunk) -> list[LayerState] | None:
        """The state at a prefix-cache hit, from the kept pages before the chunk's start."""
        pool, start = self.pool, chunk.start_position
        if pool is None or self.page_size is None or start % pool.page_size:
            return None
        pages = list(chunk.page_ids[: start // pool.page_size])
        if self.hit_pages(pages) < len(pages):
            return None
        tail = pages[max(len(pages) - window_reach(self.model.cfg, pool.page_size), 0) :]
        return restore(self.model.cfg, pool, pages, [self.slots.get(page) for page in tail])

    def _keep_pages(self, held: Held, end: int, page_ids: tuple[int, ...]) -> None:
        """The pages the step completed, into the pool at their ids (over what an earlier filling
        left)."""
        size = self.page_size
        if self.pool is None or size is None:
            return
        reach = window_reach(self.model.cfg, size)
        keep = self.slots.to_keep(page_ids, held.position // size, end // size, reach)

        def slot(page: int) -> int | None:
            return self.slots.take(page) if page in keep else None

        done = store_pages(self.model.cfg, held.layers, held.position, end, self.pool, page_ids, slot)
        self.written.update(done)
