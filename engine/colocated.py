"""The colocated engine: one process does prefill and decode over one KV pool, no transfer.

It is the reference for every other path's outputs, the baseline of the disaggregation
benchmarks and a fallback serving mode.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tandem.engine.engine_config import EngineConfig
from tandem.engine.request import Request
from tandem.engine.runner import ModelRunner
from tandem.engine.scheduler import Scheduler, SchedulerConfig
from tandem.engine.v4_runner import V4Runner
from tandem.model.grammar import GrammarCompiler, GuidedRows
from tandem.model.kv_pool import KVPool
from tandem.model.loader import AnyModel, load_model
from tandem.model.tokenizer import Tokenizer
from tandem.model.v4.kv_layout import pages_for_bytes as v4_pages_for_bytes
from tandem.model.v4.kv_layout import v4_page_size
from tandem.model.v4.model import DeepseekV4
from tandem.model.v4.pages import v4_pool
from tandem.wire.logprobs import TokenLogprobs
from tandem.wire.request_params import FinishReason, InvalidRequestError, SamplingParams, check_prompt

if TYPE_CHECKING:
    from tandem.engine.tier_copier import TierCopier


@dataclass(frozen=True)
class GenerationOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    prompt_tokens: int
    cached_tokens: int
    finish_reason: FinishReason
    # when asked for (SamplingParams.logprobs / prompt_logprobs): each output's, each prompt position's
    logprobs: list[TokenLogprobs | None] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs | None] = field(default_factory=list)


class ColocatedEngine:
    def __init__(
        self,
        model: AnyModel,
        config: EngineConfig | None = None,
        tokenizer: Tokenizer | None = None,
        lockstep: bool = False,
        guides: GuidedRows | None = None,
    ) -> None:
        """``guides``: structured outputs' matchers (made from ``tokenizer`` when not given).

        A DeepSeek-V4 model runs on pages of a multiple of every compression rate (the least
        common multiple with ``config.page_size``), as many as ``kv_pool_bytes`` holds of every
        kind of its state beside ``max_num_seqs`` requests' windows (``model/v4/kv_layout.py``: the
        compressed entries and indexer keys; with prefix caching a page keeps its tokens' window
        KV and its last window's overlap too), its prefix-cache hits restoring the exact state
        (``engine/v4_runner.py``)."""
        self.config = config = config or EngineConfig()
        self.model = model
        self.model_config = cfg = model.cfg
        self.tokenizer = tokenizer
        self.max_model_len = min(
            config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings
        )
        if guides is None and tokenizer is not None:
            guides = GuidedRows(GrammarCompiler(tokenizer, cfg.vocab_size), tokenizer.eos_token_id)
        self.pool: KVPool | None = None
        self.runner: ModelRunner | V4Runner
        prefix_caching = config.enable_prefix_caching
        if isinstance(model, DeepseekV4):
            page_size = v4_page_size(model.cfg, config.page_size)
            num_pages = config.num_pages or v4_pages_for_bytes(
                model.cfg,
                page_size,
                model.dtype.itemsize,
                config.kv_pool_bytes,
                config.max_num_seqs,
                prefix_caching=prefix_caching,
                window_share=config.v4_window_share,
            )
            share, device = config.v4_window_share, model.device
            self.pool = v4_pool(model.cfg, num_pages, page_size, model.dtype, device, prefix_caching, share)
            self.runner = V4Runner(
                model, lockstep, guides=guides, pool=self.pool, prefix_caching=prefix_caching
            )
        else:
            page_size = config.page_size
            num_pages = config.num_pages or KVPool.pages_for_bytes(
                model.cfg, page_size, model.dtype, config.kv_pool_bytes
            )
            self.pool = KVPool(model.cfg, num_pages, page_size, model.dtype, model.device)
            self.runner = ModelRunner(model, self.pool, lockstep, guides=guides)
        self.scheduler = Scheduler(
            SchedulerConfig(
                num_pages=num_pages,
                page_size=page_size,
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_model_len=self.max_model_len,
                enable_prefix_caching=prefix_caching,
                prefill_chunk_tokens=config.prefill_chunk_tokens,
            )
        )
        if isinstance(self.runner, V4Runner) and prefix_caching:  # hits where the window is kept
            self.scheduler.kv_cache.hit_pages = self.runner.hit_pages
            self.scheduler.kv_cache.better_holder = self.runner.slots.better_holder
        self.copier: TierCopier | None = None  # the host tier and the store, once attached
        self._ids = itertools.count()

    def attach_tiers(self, copier: TierCopier) -> None:
        """Put ``copier``'s host tier and store below this engine's prefix cache; every step
        then executes the copies they decide (``run_tier_ops``)."""
        self.copier = copier
        self.scheduler.kv_cache.tiers = copier.tiers
        if isinstance(self.runner, V4Runner):  # a V4 page's window KV and overlap go with it
            copier.tiers.boundary = self.runner

    def run_tier_ops(self) -> None:
        """The copies the last ``schedule`` (loads, before the forward) or ``update`` (writes of
        what the forward computed) decided."""
        if self.copier is not None:
            self.copier.run(self.copier.tiers.take_ops())

    @staticmethod
    def from_model_dir(
        model_dir: str | Path,
        dtype: torch.dtype = torch.float32,
        config: EngineConfig | None = None,
        device: str = "cpu",
    ) -> ColocatedEngine:
        """The engine over the directory's model, of either family (``model/loader.py``)."""
        model = load_model(model_dir, dtype, device)
        return ColocatedEngine(model, config, Tokenizer.from_dir(model_dir))

    def validate_prompt(self, prompt_token_ids: list[int], field: str = "prompt_ids") -> None:
        check_prompt(prompt_token_ids, self.model_config.vocab_size, self.max_model_len, field)

    def add_request(
        self, prompt_token_ids: list[int], sampling: SamplingParams, request_id: str | None = None
    ) -> str:
        sampling.validate(self.model_config.vocab_size)
        self.validate_prompt(prompt_token_ids)
        sampling = sampling.seeded()
        request_id = request_id or f"req-{next(self._ids)}"
        if sampling.guide is not None:
            if self.runner.guides is None:
                raise InvalidRequestError("guide", "structured outputs need the model's tokenizer")
            self.runner.guides.compiler.compile(sampling.guide, "guide")  # a bad spec fails here
        self.scheduler.add_request(
            Request(
                request_id=request_id,
                prompt_token_ids=list(prompt_token_ids),
                sampling=sampling,
                eos_token_ids=frozenset(self.model_config.eos_token_ids),
                max_model_len=self.max_model_len,
                arrival_s=time.monotonic(),
            )
        )
        return request_id

    def abort(self, request_id: str) -> bool:
        self.runner.forget(request_id)
        return self.scheduler.abort_request(request_id)

    def step(self) -> list[Request]:
        """One continuous-batching step; returns the requests that finished in it."""
        plan = self.scheduler.schedule()
        self.run_tier_ops()
        tokens = self.runner.run(plan)
        finished = self.scheduler.update(plan, tokens, self.runner.logprobs, self.runner.prompt_logprobs)
        self.run_tier_ops()
        for request in finished:
            self.runner.forget(request.request_id)
        return finished

    def generate(
        self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]
    ) -> list[GenerationOutput]:
        """Run all prompts concurrently to completion; outputs in input order."""
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        for prompt, p in zip(prompts, params, strict=True):  # reject bad input before anything runs
            p.validate(self.model_config.vocab_size)
            self.validate_prompt(prompt)
        ids = [self.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
        done: dict[str, Request] = {}
        while self.scheduler.has_unfinished_requests():
            for request in self.step():
                done[request.request_id] = request
        return [self._output(done[i]) for i in ids]

    def _output(self, request: Request) -> GenerationOutput:
        text = self.tokenizer.decode(request.output_token_ids) if self.tokenizer else ""
        return GenerationOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt_token_ids,
            token_ids=list(request.output_token_ids),
            text=text,
            prompt_tokens=request.num_prompt_tokens,
            cached_tokens=request.num_cached_tokens,
            finish_reason=request.finish_reason or FinishReason.LENGTH,
            logprobs=list(request.output_logprobs),
            prompt_logprobs=list(request.prompt_logprobs),
        )
