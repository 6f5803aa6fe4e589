"""Rank names: ``"<group>-r<index>"``, e.g. ``"prefill0-r1"`` is DP rank 1 of group ``prefill0``."""

from __future__ import annotations

import re

_RANK_NAME = re.compile(r"^(?P<group>.+)-r(?P<index>\d+)$")


class InvalidRankName(ValueError):
    """A rank name that is not ``<group>-r<index>``."""

    def __init__(self, name: str) -> None:
        super().__init__(f"rank name {name!r} is not '<group>-r<index>' (e.g. 'prefill0-r1')")
        self.name = name


def split_rank_name(name: str) -> tuple[str, int]:
    """``"prefill0-r1"`` -> ``("prefill0", 1)``. The last ``-r<digits>`` ends the group name."""
    found = _RANK_NAME.match(name)
    if found is None:
        raise InvalidRankName(name)
    return found["group"], int(found["index"])
