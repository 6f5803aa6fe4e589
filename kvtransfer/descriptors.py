"""From page ids to transfer descriptors.

Source page ``src[i]`` goes to destination page ``dst[i]``. Pairs are ordered by destination page
and cut into runs where both sides are contiguous, so each run becomes one descriptor of
``run_length * page_bytes`` (NIXL merges adjacent entries of a prepared list; the run count is what
it ends up with)::

    src  7 8 9 2 3      dst  4 5 6 10 11   ->  runs (src 7, dst 4, 3 pages), (src 2, dst 10, 2 pages)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PageRun:
    src_page: int
    dst_page: int
    pages: int


def page_runs(src_pages: Sequence[int], dst_pages: Sequence[int]) -> list[PageRun]:
    if len(src_pages) != len(dst_pages):
        raise ValueError(f"{len(src_pages)} source pages but {len(dst_pages)} destination pages")
    runs: list[PageRun] = []
    for dst, src in sorted(zip(dst_pages, src_pages, strict=True)):
        last = runs[-1] if runs else None
        if last and dst == last.dst_page + last.pages and src == last.src_page + last.pages:
            runs[-1] = PageRun(last.src_page, last.dst_page, last.pages + 1)
        else:
            runs.append(PageRun(src, dst, 1))
    return runs
