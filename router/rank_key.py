"""The key the router knows a rank by: any hashable, ordered value that prints as the rank's name.

The router never looks inside a key. It hashes keys (dicts and sets of ranks), orders them
(``set_ranks`` sorts each role's ranks, and the last tie-break of a choice is the smaller key),
and formats them (the tie-break salt hashes ``f"{salt}/{rank}"``, and error messages). Two keys
fit: plain names (``str``: the tests, the router bench) and ``tandem.wire.messages.RankId``,
whose ``str`` is its name, so a salted tie-break is the same for a RankId and its name. Their
orders differ: a RankId orders by (group, rank number), a name by its characters, so
``g-r2 < g-r10`` as RankIds but not as names.

``K`` defaults to ``str`` for type checkers (PEP 696), so a bare ``Router()`` or ``Router`` in
an annotation means ``Router[str]``; ``Router[RankId](config)`` or an annotated target picks
RankId. Python 3.11's ``typing.TypeVar`` takes no default at run time, hence the split below
(the default only matters to the type checker).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol, TypeVar


class RankKey(Protocol):
    """Hashable, ordered among its own kind, and printed as the rank's name."""

    def __hash__(self) -> int: ...

    def __lt__(self, other: Any, /) -> bool: ...

    def __str__(self) -> str: ...


if TYPE_CHECKING:
    K = TypeVar("K", bound=RankKey, default=str)
else:
    K = TypeVar("K", bound=RankKey)
