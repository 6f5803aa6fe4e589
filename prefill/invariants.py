"""The prefill scheduler's invariants, checked on demand (tests, and ``TANDEM_CHECK_INTEGRITY``
ranks): each job in exactly one of queued, computing and transferring, in that state, with the
pages its progress holds, one job at most mid-prefill, every page's reference count the number
of jobs that hold it, a shared page cached, and a cached page holding the prefix its job's
tokens hash to. Torch-free."""

from __future__ import annotations

import math
from collections.abc import Mapping

from tandem.engine.page_allocator import PageAccountingError
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.request import RequestStatus
from tandem.prefill.job_state import JobState
from tandem.wire.block_chain import block_hashes


def check_prefill_invariants(
    cache: PrefixCache,
    queued: Mapping[str, JobState],
    computing: Mapping[str, JobState],
    transferring: Mapping[str, JobState],
) -> None:
    """Raise ``PageAccountingError`` unless the prefill scheduler's jobs (queued, computing,
    transferring) and its KV pool agree (O(all tokens): for tests)."""
    cache.check_integrity()
    groups = (
        (RequestStatus.WAITING, queued),
        (RequestStatus.RUNNING, computing),
        (RequestStatus.SENDING_KV, transferring),
    )
    seen: set[str] = set()
    owners: dict[int, int] = {}
    for status, jobs in groups:
        for rid, state in jobs.items():
            if rid in seen or rid != state.job.request_id or state.status != status:
                raise PageAccountingError(f"job {rid} is listed twice or under the wrong state")
            seen.add(rid)
            _check_job(state, cache)
            for page_id in state.page_ids:
                owners[page_id] = owners.get(page_id, 0) + 1
    mid_prefill = [r for r, s in computing.items() if s.scheduled_end < s.job.num_prompt_tokens]
    if len(mid_prefill) > 1:
        raise PageAccountingError(f"more than one job is mid-prefill: {mid_prefill}")
    for page_id in range(cache.num_total_pages):
        count, refcount = owners.get(page_id, 0), cache.refcount(page_id)
        if count != refcount:
            raise PageAccountingError(f"page {page_id}: refcount {refcount} but {count} owning jobs")
        if count > 1 and not cache.is_cached(page_id):
            raise PageAccountingError(f"page {page_id} is shared by {count} jobs but not cached")


def _check_job(state: JobState, cache: PrefixCache) -> None:
    size = cache.page_size
    rid, pages, prompt = state.job.request_id, state.page_ids, state.job.prompt_token_ids
    computed = state.num_computed_tokens
    if state.status == RequestStatus.WAITING:
        if pages or computed:
            raise PageAccountingError(f"queued job {rid} holds pages or computed tokens")
        return
    if len(set(pages)) != len(pages):
        raise PageAccountingError(f"job {rid} lists a page twice: {pages}")
    if not state.num_cached_tokens <= computed <= state.scheduled_end <= len(prompt):
        raise PageAccountingError(
            f"job {rid}: cached {state.num_cached_tokens}, computed {computed}, "
            f"planned {state.scheduled_end} of {len(prompt)} tokens"
        )
    if len(pages) != math.ceil(state.scheduled_end / size):
        raise PageAccountingError(f"job {rid}: {len(pages)} pages for {state.scheduled_end} tokens")
    if state.status == RequestStatus.SENDING_KV and computed != len(prompt):
        raise PageAccountingError(f"transferring job {rid} computed only {computed} of {len(prompt)}")
    expected_hashes = block_hashes(prompt[:computed], size, state.job.cache_salt)
    for page_id, expected in zip(pages, expected_hashes, strict=False):
        cached = cache.cached_hash(page_id)
        if cached is not None and cached != expected:
            raise PageAccountingError(f"job {rid} uses cached page {page_id} of another prefix")
