"""The decode scheduler's invariants, checked on demand (tests, and ``TANDEM_CHECK_INTEGRITY``
ranks): each unfinished request is in exactly one of the queue, the wait for KV and the running
batch, in the state that container means, with the pages that state holds, and every page's
reference count is the number of requests that hold it. Torch-free."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from tandem.decode.decode_request import DecodeRequest
from tandem.decode.types import DecodeSchedulerConfig
from tandem.engine.page_allocator import PageAccountingError
from tandem.engine.prefix_cache import PrefixCache
from tandem.engine.request import RequestStatus


def check_decode_invariants(
    config: DecodeSchedulerConfig,
    kv_cache: PrefixCache,
    entries: Mapping[str, DecodeRequest],
    queue: Sequence[DecodeRequest],
    waiting: Sequence[DecodeRequest],
    running: Sequence[DecodeRequest],
) -> None:
    """Raise ``PageAccountingError`` unless the scheduler's containers (the queue, the wait for
    KV, the running batch) and its KV pool agree (O(pages + requests))."""
    kv_cache.check_integrity()
    size = config.page_size
    containers = [
        (RequestStatus.WAITING, queue),
        (RequestStatus.WAITING_FOR_KV, waiting),
        (RequestStatus.RUNNING, running),
    ]
    held = [e for _, inside in containers for e in inside]
    if len({id(e) for e in held}) != len(held) or {e.request.request_id for e in held} != set(entries):
        raise PageAccountingError("queue, waiting-for-KV and running do not hold each request exactly once")
    if len(waiting) > config.max_reservations_in_flight:
        raise PageAccountingError(f"{len(waiting)} requests wait for KV > the limit")
    orders = [e.order for e in running]
    if orders != sorted(orders):
        raise PageAccountingError("running requests are not in arrival order")
    owners: dict[int, int] = {}
    for where, inside in containers:
        for entry in inside:
            _check_entry(where, entry, size)
            for page_id in entry.request.page_ids:
                owners[page_id] = owners.get(page_id, 0) + 1
    for page_id in range(kv_cache.num_total_pages):  # a forked request shares its parent's
        count, refcount = owners.get(page_id, 0), kv_cache.refcount(page_id)
        if count != refcount:
            raise PageAccountingError(f"page {page_id}: refcount {refcount} but {count} owning requests")


def _check_entry(where: RequestStatus, entry: DecodeRequest, size: int) -> None:
    request = entry.request
    rid, pages, has_outputs = request.request_id, request.page_ids, bool(request.output_token_ids)
    if where is RequestStatus.WAITING:
        queued = RequestStatus.PREEMPTED if has_outputs else RequestStatus.WAITING
        if request.status is not queued:
            raise PageAccountingError(f"queued {rid} is {request.status.name}")
        if pages or request.num_computed_tokens or entry.aborting:
            raise PageAccountingError(f"queued {rid} holds pages or computed tokens, or is aborting")
        return
    if request.status is not where:
        raise PageAccountingError(f"{rid} is {request.status.name} but held as {where.name}")
    if where is RequestStatus.WAITING_FOR_KV:
        expected = request.num_tokens - 1 if has_outputs else request.num_prompt_tokens
        if entry.num_reserved_tokens != expected:
            raise PageAccountingError(f"{rid} waits for KV of {entry.num_reserved_tokens} tokens")
        if len(pages) != math.ceil(expected / size):
            raise PageAccountingError(f"{rid} reserved {len(pages)} pages for {expected} tokens")
        return
    if has_outputs == entry.forked or entry.aborting:  # only a forked one runs before its first
        raise PageAccountingError(f"running {rid}: outputs {has_outputs}, forked {entry.forked}, aborting")
    if request.num_computed_tokens != request.num_tokens - 1:
        raise PageAccountingError(f"running {rid} computed {request.num_computed_tokens} tokens")
    if (
        not math.ceil((request.num_tokens - 1) / size)
        <= len(pages)
        <= math.ceil((request.num_tokens + entry.num_drafts) / size)
    ):
        raise PageAccountingError(f"running {rid} has {len(pages)} pages for {request.num_tokens} tokens")
