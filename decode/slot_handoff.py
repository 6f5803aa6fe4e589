"""A decode rank's state slots (DeepSeek-V4, ``model/v4/state_slots.py``): one reserved with a
job's pages and named in its destination, held until the receive is over (a late write can land
in it until then); when the KV is in, what the runner takes the request on from. Torch-free."""

from __future__ import annotations

import dataclasses

from tandem.engine.slot_owners import SlotOwners
from tandem.kvtransfer.types import KVDestination


class SlotHandoff:
    def __init__(self, count: int) -> None:
        self.owners = SlotOwners(count)
        self._adopt: dict[str, tuple[int, tuple[int, ...]]] = {}  # key -> prompt tokens, pages

    def reserve(self, key: str, destination: KVDestination, prompt_tokens: int) -> KVDestination | None:
        """The destination naming a slot for transfer ``key``; ``None`` when every slot awaits one."""
        slot = self.owners.take(key)
        if slot is None:
            return None
        self._adopt[key] = (prompt_tokens, destination.page_ids)
        return dataclasses.replace(destination, state_slot=slot)

    def arrived(self, key: str) -> tuple[int, tuple[int, ...], int] | None:
        """Transfer ``key``'s KV is in: ``(prompt tokens, pages, slot)`` to take the request on
        from (read before the slot is given to another transfer, on the same loop)."""
        slot, adopt = self.owners.get(key), self._adopt.pop(key, None)
        self.owners.release(key)
        return None if slot is None or adopt is None else (*adopt, slot)

    def over(self, key: str) -> None:
        """Transfer ``key`` failed: nothing more lands in its slot."""
        self.owners.release(key)
        self._adopt.pop(key, None)

    def stray(self, awaited: set[str]) -> set[str]:
        """Slots held by no transfer in ``awaited`` (an integrity fault)."""
        return (self.owners.owners() | set(self._adopt)) - awaited
