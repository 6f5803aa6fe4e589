"""Which pages' window KV a DeepSeek-V4 rank keeps for prefix-cache hits (torch-free).

A hit at a page boundary restores the sliding window (and CSA's overlap) from the pages before
it (``model/v4/pages.restore``). Keeping those on every page would cost four fifths of a
V4-Flash page (``tandem plan memory``); the pool keeps them in ``capacity`` slots instead (a
share of the pages: ``model/page_kinds.PageKind.share``). A request's pages take slots as they
complete, not all of them: every ``every``-th page of the request (``every`` about one over the
share), so a cached run has a restorable boundary at most ``every`` pages before its end, and
the last page a step completes (a prompt's end, where the next turn's prompt goes on). When no
slot is free the least recently used page's is taken back; a page's slot goes when the page is
filled again. A boundary is restorable when every page its window reaches into holds a slot, so
hits land on those boundaries (``PrefixCache.hit_pages`` cuts a matched run down to one), and a
page computed again where a hit was cut takes over its tokens' hash from the older page without
a slot (``PrefixCache.better_holder``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Sequence


class WindowSlots:
    def __init__(self, capacity: int, every: int = 1) -> None:
        if capacity < 0 or every < 1:
            raise ValueError(f"window slots must be 0 or more, every 1 or more page, got {capacity}, {every}")
        self.capacity, self.every = capacity, every
        self._slots: OrderedDict[int, int] = OrderedDict()  # page id -> slot, least recent first
        self._free = list(range(capacity - 1, -1, -1))

    @classmethod
    def for_share(cls, capacity: int, share: float) -> WindowSlots:
        """``capacity`` slots for ``share`` of the pages: a slot every ``1 / share`` pages."""
        return cls(capacity, every=max(round(1 / share), 1))

    def __len__(self) -> int:
        return len(self._slots)

    def has(self, page: int) -> bool:
        return page in self._slots

    def peek(self, page: int) -> int | None:
        """``page``'s slot (``None``: none), its recency left as it is."""
        return self._slots.get(page)

    def get(self, page: int) -> int:
        """``page``'s slot, now the most recently used."""
        self._slots.move_to_end(page)
        return self._slots[page]

    def take(self, page: int) -> int | None:
        """A slot for ``page`` (its own if it has one), the least recently used page's when none
        is free; ``None`` with no slots at all."""
        if page in self._slots:
            return self.get(page)
        if self._free:
            slot = self._free.pop()
        elif self._slots:
            _, slot = self._slots.popitem(last=False)
        else:
            return None
        self._slots[page] = slot
        return slot

    def to_keep(self, page_ids: Sequence[int], first: int, end: int, reach: int) -> set[int]:
        """Of a request's pages completed in one step (``page_ids[first:end]``, ``page_ids`` its
        pages from its first token), those to take a slot: every ``every``-th of the request
        and the step's last, each with the ``reach - 1`` before it."""
        ends = [i for i in range(first, end) if (i + 1) % self.every == 0 or i == end - 1]
        return {page_ids[j] for i in ends for j in range(max(i - reach + 1, first), i + 1)}

    def restorable(self, page_ids: Sequence[int], written: Collection[int], reach: int) -> int:
        """The most leading pages of ``page_ids`` (a matched run) a hit may use: written pages
        (their entries whole) whose last ``reach`` hold slots."""
        whole = next((i for i, page in enumerate(page_ids) if page not in written), len(page_ids))
        for n in range(whole, 0, -1):
            if all(page in self._slots for page in page_ids[max(n - reach, 0) : n]):
                return n
        return 0

    def better_holder(self, holder: int, page: int) -> bool:
        """``page``, just computed, should hold its tokens' hash rather than ``holder`` (an
        older page of the same tokens): it has a slot and the older one none (a hit cut short
        there computed it again: it is restorable, the older page no longer)."""
        return page in self._slots and holder not in self._slots

    def release(self, page: int) -> None:
        """``page`` is filled again: its slot is free."""
        slot = self._slots.pop(page, None)
        if slot is not None:
            self._free.append(slot)
