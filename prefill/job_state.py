"""A prefill job's progress on its prefill rank, as the prefill scheduler keeps it. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.request import RequestStatus
from tandem.wire.prefill_job import PrefillJob


@dataclass(eq=False)
class JobState:
    """A job's progress; only the scheduler changes it. ``page_ids[i]`` holds positions
    ``[i*page_size, (i+1)*page_size)``; ``scheduled_end`` is where the planned chunk ends
    (equal to ``num_computed_tokens`` when no chunk is in flight)."""

    job: PrefillJob
    arrival_s: float
    status: RequestStatus = RequestStatus.WAITING
    page_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0
    num_host_tokens: int = 0  # of the cached ones, loaded from the host tier
    num_store_tokens: int = 0  # and from the store
    scheduled_end: int = 0
    start_s: float = 0.0
