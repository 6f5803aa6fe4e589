from __future__ import annotations

import pytest

from tandem.engine.page_allocator import PageAccountingError, PageAllocator


def test_allocate_is_all_or_nothing() -> None:
    allocator = PageAllocator(4)
    first = allocator.allocate(3)
    assert first is not None and len(set(first)) == 3
    assert allocator.allocate(2) is None
    assert allocator.num_free == 1
    assert allocator.allocate(0) == []
    last = allocator.allocate(1)
    assert last is not None and set(first) | set(last) == {0, 1, 2, 3}
    assert all(allocator.refcount(p) == 1 for p in range(4))
    allocator.check_integrity()


def test_decref_releases_pages_at_zero() -> None:
    allocator = PageAllocator(3)
    pages = allocator.allocate(2)
    assert pages is not None
    allocator.incref(pages[:1])
    assert allocator.decref(pages) == [pages[1]]
    assert allocator.num_free == 2 and allocator.is_free(pages[1])
    assert allocator.decref(pages[:1]) == [pages[0]]
    assert allocator.num_free == 3
    allocator.check_integrity()


def test_parked_pages_are_accounted_by_their_owner() -> None:
    allocator = PageAllocator(3)
    pages = allocator.allocate(2)
    assert pages is not None
    parked = allocator.decref(pages, release=False)
    assert parked == pages and allocator.num_free == 1
    with pytest.raises(PageAccountingError, match="leaked"):
        allocator.check_integrity()
    allocator.check_integrity(parked=parked)
    allocator.incref(parked[:1])  # a parked page can be reused in place
    allocator.release(parked[1:])
    assert allocator.refcount(parked[0]) == 1 and allocator.num_free == 2
    allocator.check_integrity()


def test_misuse_raises_page_accounting_error() -> None:
    allocator = PageAllocator(2)
    pages = allocator.allocate(1)
    assert pages is not None
    free_page = 1 - pages[0]
    with pytest.raises(PageAccountingError, match="incref of free page"):
        allocator.incref([free_page])
    with pytest.raises(PageAccountingError, match=r"release of page \d+ with refcount 1"):
        allocator.release(pages)
    allocator.decref(pages)
    with pytest.raises(PageAccountingError, match="freed twice"):
        allocator.decref(pages)
    with pytest.raises(PageAccountingError, match="already free"):
        allocator.release([free_page])
    with pytest.raises(PageAccountingError, match="outside the pool"):
        allocator.refcount(2)
    with pytest.raises(PageAccountingError, match="outside the pool"):
        allocator.incref([-1])
    with pytest.raises(ValueError, match="negative"):
        allocator.allocate(-1)
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(0)
    allocator.check_integrity()


def test_check_integrity_finds_corruption() -> None:
    allocator = PageAllocator(3)
    allocator._free.append(0)
    with pytest.raises(PageAccountingError, match="free list twice"):
        allocator.check_integrity()

    allocator = PageAllocator(3)
    allocator._refcounts[1] = 2
    with pytest.raises(PageAccountingError, match="both free and referenced"):
        allocator.check_integrity()

    allocator = PageAllocator(3)
    pages = allocator.allocate(1)
    assert pages is not None
    with pytest.raises(PageAccountingError, match="parked page"):
        allocator.check_integrity(parked=pages)
