"""Decode choice: a rank with room for the request, and of those the least busy.

::

    room      reported free pages - pages promised to requests not yet in a report >= needed
              (a rank that has not reported yet counts as having room: its pool is fresh)
    among ranks with room:   fewest requests, then most free pages
    no rank has room:        most free pages (the rank queues the request until pages free up)

A rank's request count is the larger of what it last reported running and what this router
has in flight on it: the first includes other frontends' requests, the second counts requests
the report has not caught up with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic

from tandem.router.rank_key import K


@dataclass(frozen=True)
class DecodeCandidate(Generic[K]):
    rank: K
    num_requests: int
    free_pages: float  # reported free minus promised; math.inf before the first report
    tie_break: int = 0  # the router's own order of ranks (0: by rank key)


def choose_decode_rank(candidates: Sequence[DecodeCandidate[K]], pages_needed: int) -> DecodeCandidate[K]:
    """``candidates`` must not be empty; ties go by the router's order, then the rank key."""
    with_room = [c for c in candidates if c.free_pages >= pages_needed]
    if with_room:
        return min(with_room, key=lambda c: (c.num_requests, -c.free_pages, c.tie_break, c.rank))
    return min(candidates, key=lambda c: (-c.free_pages, c.num_requests, c.tie_break, c.rank))
