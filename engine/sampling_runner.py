"""What every model runner does once the forward has run: sample each chunk's tokens (guided
rows by their matchers), their logprobs and the prompt's, and keep the hidden states an MTP
drafter reads; the runner's share of a step's split. A family's runner (``engine/runner.py``
for DeepSeek-V3, ``engine/v4_runner.py`` for V4) builds the forward."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Protocol

import torch

from tandem.engine.host_sync import no_host_sync
from tandem.engine.scheduler_output import ScheduledChunk, SchedulerOutput
from tandem.engine.speculation import accept
from tandem.kvtransfer.types import READY, ReadyEvent
from tandem.model.expert_dispatch import ExpertDispatcher
from tandem.model.grammar import GuidedRows
from tandem.model.sampler import History, logprobs_of, sample
from tandem.wire.logprobs import TokenLogprobs
from tandem.wire.messages import StepSplit
from tandem.wire.request_params import InvalidRequestError, SamplingParams

_LOGIT_ROWS = 256  # prompt positions whose logits are computed together (prompt logprobs)


class SampledModel(Protocol):
    """What the sampling half of a runner reads of a model."""

    @property
    def device(self) -> torch.device: ...

    @property
    def dispatcher(self) -> ExpertDispatcher: ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor: ...

    def weight_bytes(self) -> int: ...


@dataclass
class RunnerStats:
    steps: int = 0
    prepare_s: float = 0.0  # input and attention-metadata tensors
    forward_s: float = 0.0
    sample_s: float = 0.0


class SamplingRunner:
    """``lockstep``: this rank is one of a DEP group, whose MoE layers exchange rows with the other
    ranks, so it runs the model even on an empty plan (an empty batch) to take part.
    ``guides``: the matchers of structured outputs (requests with a ``guide``).
    ``guard_syncs``: every forward that is meant not to wait for the device (all but a DEP
    group's split exchange: ``ExpertDispatcher.syncs_host``) runs under ``no_host_sync``, which
    fails the step on any read of a device value before sampling (``TANDEM_SYNC_GUARD=1``;
    off by default: a check, not a price to pay while serving).
    ``keep_hidden``: the hidden states of every sampled row are kept until the next step
    (``hidden_rows``), for an MTP drafter."""

    def __init__(
        self,
        model: SampledModel,
        lockstep: bool = False,
        guides: GuidedRows | None = None,
        guard_syncs: bool | None = None,
        keep_hidden: bool = False,
    ) -> None:
        self.sampled_model = model
        self._weight_bytes: int | None = None
        self.lockstep = lockstep
        self.stats = RunnerStats()
        self.guides = guides
        self.guard_syncs = (
            os.environ.get("TANDEM_SYNC_GUARD", "") == "1" if guard_syncs is None else guard_syncs
        )
        self.guarded_forwards = 0  # forwards run under the guard
        self.keep_hidden = keep_hidden
        self._hidden: torch.Tensor | None = None
        self._hidden_at: dict[str, tuple[int, int]] = {}  # request -> (first row, rows) in _hidden
        # the last step's logprobs: each sampled row's, of the requests that asked (``logprobs``),
        # and the prompt positions' (request -> the first position predicted, its entries)
        self.logprobs: dict[str, list[TokenLogprobs]] = {}
        self.prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = {}

    @property
    def weight_bytes(self) -> int:
        """The model's weights resident on the device (FP8 weights 1 byte each), counted once."""
        if self._weight_bytes is None:
            self._weight_bytes = self.sampled_model.weight_bytes()
        return self._weight_bytes

    def prepare_guide(self, sampling: SamplingParams) -> None:
        """Start compiling a request's guide (if it has one) off the step's thread."""
        if sampling.guide is not None and self.guides is not None:
            with contextlib.suppress(InvalidRequestError):  # a full queue: ``guide_ready`` says so
                self.guides.compiler.prepare(sampling.guide)

    def guide_ready(self, request_id: str, sampling: SamplingParams, asked_s: float) -> bool:
        """Whether a step may sample ``request_id`` under its guide now: compiled, or none to
        compile; never waits (``GrammarCompiler.poll``, ``asked_s`` when the request arrived).
        A guide that does not compile here, or not within the limit, raises
        ``InvalidRequestError`` naming ``guide``, and the request's rows get only EOS from then
        on (a step that samples it ends it)."""
        guide = sampling.guide
        if guide is None or self.guides is None:
            return True
        try:
            return self.guides.compiler.poll(guide, asked_s) is not None
        except InvalidRequestError:
            self.guides.mark_broken(request_id, guide)
            raise

    def forget_guide(self, request_id: str) -> None:
        if self.guides is not None:
            self.guides.forget(request_id)

    def split(self, schedule_s: float = 0.0, update_s: float = 0.0, draft_s: float = 0.0) -> StepSplit:
        """This runner's share of a rank's step split, with the worker's own pieces."""
        s = self.stats
        return StepSplit(schedule_s, s.prepare_s, s.forward_s, s.sample_s, update_s, draft_s)

    def forget(self, request_id: str) -> None:
        """A request is over here (finished, aborted or moved): drop what is kept for it."""
        self.forget_guide(request_id)

    def kv_event(self) -> ReadyEvent:
        """An event that completes once the KV queued so far is in the pool. On a GPU the kernels
        run asynchronously: a CUDA event recorded on the compute stream, which a transfer polls
        before it reads the pool (nothing here waits on the device). On a CPU the forward is
        synchronous and the KV is there already."""
        if self.sampled_model.device.type != "cuda":
            return READY
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.sampled_model.device))
        return event

    def run(self, plan: SchedulerOutput) -> dict[str, int]:
        """Compute the planned chunks and sample a token for each chunk that asks for one."""
        if any(c.draft_token_ids for c in plan.chunks):
            raise ValueError("a plan with drafts is verified (ModelRunner.verify), not run")
        return {rid: tokens[0] for rid, tokens in self.verify(plan).items()}

    def verify(self, plan: SchedulerOutput) -> dict[str, tuple[int, ...]]:
        raise NotImplementedError

    @contextlib.contextmanager
    def _guarded(self) -> Iterator[None]:
        """The forward under ``no_host_sync`` when the guard is on and the forward is meant to
        need none."""
        if not self.guard_syncs or self.sampled_model.dispatcher.syncs_host:
            yield
            return
        with no_host_sync(self.sampled_model.device):
            yield
        self.guarded_forwards += 1

    def _sample(
        self, plan: SchedulerOutput, forward: Callable[[SchedulerOutput], torch.Tensor], start: float
    ) -> dict[str, tuple[int, ...]]:
        """``forward(plan)`` gives the hidden rows the chunks sample at, in plan order."""
        t0 = time.perf_counter()
        rows = forward(plan)
        t1 = time.perf_counter()
        sampled: dict[str, tuple[int, ...]] = {}
        chunks = [c for c in plan.chunks if c.sample]
        if chunks:
            logits = self.sampled_model.compute_logits(rows)
            params, seeds, indices = [], [], []
            histories: list[History | None] = []
            for c in chunks:
                seed = seed_of(c.request_id, c.sampling)
                for j in range(c.num_sampled):  # output o + j is drawn with (seed, o + j)
                    params.append(c.sampling)
                    seeds.append(seed)
                    indices.append(c.output_index + j)
                    # a verify row's outputs so far end with the drafts before it
                    history = c.history
                    histories.append(
                        None if history is None else (history[0], (*history[1], *c.draft_token_ids[:j]))
                    )
            tokens = sample(
                logits, params, seeds, indices, histories, self._allowed(params, chunks, histories)
            )
            self._output_logprobs(chunks, logits, tokens)
            at = 0
            for c in chunks:
                target = tokens[at : at + c.num_sampled]
                if self.keep_hidden:
                    self._hidden_at[c.request_id] = (at, c.num_sampled)
                at += c.num_sampled
                sampled[c.request_id] = accept(c.draft_token_ids, target)
        if self.keep_hidden:
            self._hidden = rows
        self.stats.steps += 1
        self.stats.prepare_s += t0 - start
        self.stats.forward_s += t1 - t0
        self.stats.sample_s += time.perf_counter() - t1
        return sampled

    def _allowed(
        self, params: list[SamplingParams], chunks: list[ScheduledChunk], histories: list[History | None]
    ) -> tuple[list[int], torch.Tensor] | None:
        """The sampled rows of guided requests and the tokens each may take (its matcher fed
        the outputs before it)."""
        rows = [i for i, p in enumerate(params) if p.guide is not None]
        if not rows:
            return None
        if self.guides is None:
            raise ValueError("a request with a guide on a rank without structured outputs (no tokenizer)")
        owners = [c.request_id for c in chunks for _ in range(c.num_sampled)]
        asks = []
        for i in rows:
            guide, history = params[i].guide, histories[i]
            assert guide is not None
            if history is None:
                raise ValueError(f"request {owners[i]}: a guided row needs its outputs so far")
            asks.append((owners[i], guide, history[1]))
        return rows, self.guides.allowed(asks)

    def _output_logprobs(self, chunks: list[ScheduledChunk], logits: torch.Tensor, tokens: list[int]) -> None:
        """The logprobs of each sampled row of the chunks whose request asked for them, from the
        logits that sampled it (a verify chunk's: one a row, for the drafts it may accept)."""
        rows: list[int] = []
        top: list[int] = []
        owners: list[tuple[str, int]] = []
        at = 0
        for c in chunks:
            if c.sampling.logprobs is not None:
                rows.extend(range(at, at + c.num_sampled))
                top.extend([c.sampling.logprobs] * c.num_sampled)
                owners.append((c.request_id, c.num_sampled))
            at += c.num_sampled
        if not rows:
            return
        index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
        entries = logprobs_of(logits[index], [tokens[r] for r in rows], top)
        at = 0
        for request_id, count in owners:
            self.logprobs[request_id] = entries[at : at + count]
            at += count

    def _prompt_logprobs(self, plan: SchedulerOutput, offsets: list[int], hidden: torch.Tensor) -> None:
        """Each chunk's prompt positions' logprobs (``ScheduledChunk.prompt_logprob_targets``),
        their logits computed a slice of rows at a time (a long prompt's at once would hold
        ``rows x vocab`` floats)."""
        for chunk, first in zip(plan.chunks, offsets, strict=True):
            targets = chunk.prompt_logprob_targets
            if not targets:
                continue
            k = chunk.sampling.prompt_logprobs or 0
            entries: list[TokenLogprobs] = []
            for at in range(0, len(targets), _LOGIT_ROWS):
                part = targets[at : at + _LOGIT_ROWS]
                logits = self.sampled_model.compute_logits(hidden[first + at : first + at + len(part)])
                entries += logprobs_of(logits, part, [k] * len(part))
            self.prompt_logprobs[chunk.request_id] = (chunk.start_position + 1, entries)

    def hidden_rows(self, request_id: str, count: int) -> torch.Tensor:
        """The hidden states (after the final norm) of the first ``count`` positions the last
        step sampled for ``request_id``: a verify chunk's last token and drafts, in order."""
        at = self._hidden_at.get(request_id)
        if self._hidden is None or at is None or count > at[1]:
            raise KeyError(f"no {count} hidden rows of {request_id} from the last step")
        return self._hidden[at[0] : at[0] + count]

    def hidden_state(self, request_id: str) -> bytes:
        """The last hidden state the last step computed for ``request_id`` (its last position),
        as float32 bytes: what an MTP drafter on the decode rank starts from."""
        return self.hidden_rows(request_id, 1)[-1:].float().cpu().numpy().tobytes()


def seed_of(request_id: str, sampling: SamplingParams) -> int:
    """The seed of a chunk's draw. Admission seeds every request (``SamplingParams.seeded``): one
    that samples without a seed would share its draws with every other such request."""
    if sampling.seed is not None:
        return sampling.seed
    if sampling.greedy:
        return 0  # no draw is made
    raise ValueError(f"request {request_id}: sampling at temperature {sampling.temperature} without a seed")
