"""Reference-counted pages of one rank's KV pool.

Every page is in exactly one of three states::

    free       in the free list, refcount 0            -> allocate() hands it out
    used       refcount >= 1 (one per owning request)  -> decref() to 0 ...
    parked     refcount 0, not in the free list        -> ... unless release=False: the caller
                                                          keeps it (the prefix cache's evictable
                                                          pages) until release() or incref()

The allocator never decides what a parked page is for; its owner passes the parked set to
``check_integrity`` so that ``free + used + parked == total`` can be checked.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection, Iterable


class PageAccountingError(AssertionError):
    """A page was freed twice, shared without a reference, leaked, or lost: a bug, not bad input."""


class PageAllocator:
    """Pages ``0 .. num_pages-1``, each with a reference count. All operations are O(pages touched)."""

    def __init__(self, num_pages: int) -> None:
        if not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"num_pages must be a positive integer, got {num_pages!r}")
        self._num_pages = num_pages
        self._refcounts = [0] * num_pages
        self._is_free = [True] * num_pages
        self._free: deque[int] = deque(range(num_pages))

    @property
    def num_pages(self) -> int:
        return self._num_pages

    @property
    def num_free(self) -> int:
        return len(self._free)

    def refcount(self, page_id: int) -> int:
        self._check_id(page_id)
        return self._refcounts[page_id]

    def is_free(self, page_id: int) -> bool:
        self._check_id(page_id)
        return self._is_free[page_id]

    def allocate(self, n: int) -> list[int] | None:
        """``n`` free pages with refcount 1, or ``None`` (and nothing taken) when fewer are free."""
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of pages ({n})")
        if n > len(self._free):
            return None
        page_ids = [self._free.popleft() for _ in range(n)]
        for page_id in page_ids:
            self._is_free[page_id] = False
            self._refcounts[page_id] = 1
        return page_ids

    def incref(self, page_ids: Iterable[int]) -> None:
        """Add one owner to each page; a parked page (refcount 0) becomes used again."""
        for page_id in page_ids:
            self._check_id(page_id)
            if self._is_free[page_id]:
                raise PageAccountingError(f"incref of free page {page_id}: allocate it instead")
            self._refcounts[page_id] += 1

    def decref(self, page_ids: Iterable[int], *, release: bool = True) -> list[int]:
        """Drop one owner from each page; return the pages whose count reached 0, in order.

        With ``release`` those pages go back to the free list; without it they are parked and
        the caller must later ``release`` or ``incref`` them.
        """
        dropped: list[int] = []
        for page_id in page_ids:
            self._check_id(page_id)
            if self._refcounts[page_id] <= 0:
                raise PageAccountingError(f"decref of page {page_id} with refcount 0 (freed twice?)")
            self._refcounts[page_id] -= 1
            if self._refcounts[page_id] == 0:
                dropped.append(page_id)
        if release:
            self.release(dropped)
        return dropped

    def release(self, page_ids: Iterable[int]) -> None:
        """Return parked pages (refcount 0, not free) to the end of the free list."""
        for page_id in page_ids:
            self._check_id(page_id)
            if self._is_free[page_id]:
                raise PageAccountingError(f"release of page {page_id}, which is already free")
            if self._refcounts[page_id] != 0:
                raise PageAccountingError(
                    f"release of page {page_id} with refcount {self._refcounts[page_id]}: decref it first"
                )
            self._is_free[page_id] = True
            self._free.append(page_id)

    def check_integrity(self, parked: Collection[int] = ()) -> None:
        """Raise ``PageAccountingError`` unless free, used and ``parked`` pages partition the pool."""
        seen_free: set[int] = set()
        for page_id in self._free:
            if page_id in seen_free:
                raise PageAccountingError(f"page {page_id} is in the free list twice")
            seen_free.add(page_id)
            if not self._is_free[page_id]:
                raise PageAccountingError(f"page {page_id} is in the free list but not marked free")
        parked_set = set(parked)
        num_used = 0
        for page_id, count in enumerate(self._refcounts):
            if count < 0:
                raise PageAccountingError(f"page {page_id} has negative refcount {count}")
            if self._is_free[page_id] and page_id not in seen_free:
                raise PageAccountingError(f"page {page_id} is marked free but not in the free list")
            if self._is_free[page_id] and count > 0:
                raise PageAccountingError(f"page {page_id} is both free and referenced ({count})")
            if page_id in parked_set and (count > 0 or self._is_free[page_id]):
                state = "free" if self._is_free[page_id] else f"referenced ({count})"
                raise PageAccountingError(f"parked page {page_id} is {state}")
            if count == 0 and not self._is_free[page_id] and page_id not in parked_set:
                raise PageAccountingError(f"page {page_id} leaked: refcount 0, neither free nor parked")
            num_used += count > 0
        if len(seen_free) + num_used + len(parked_set) != self._num_pages:
            raise PageAccountingError(
                f"free {len(seen_free)} + used {num_used} + parked {len(parked_set)} "
                f"!= total {self._num_pages}"
            )

    def _check_id(self, page_id: int) -> None:
        if not 0 <= page_id < self._num_pages:
            raise PageAccountingError(f"page id {page_id} outside the pool of {self._num_pages} pages")
