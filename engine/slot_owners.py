"""Which request holds which slot of a rank's per-request state slots (``model/v4/state_slots.py``)
while its transfer is in flight: a prefill rank's from the step that begins the send until the
send is over, a decode rank's from the job's dispatch until the receive is over (a late write
can land in it until then). Torch-free."""

from __future__ import annotations

from tandem.kvtransfer.types import KVTransferError


class SlotOwners:
    def __init__(self, count: int) -> None:
        self._free = list(range(count - 1, -1, -1))
        self._held: dict[str, int] = {}

    def take(self, owner: str) -> int | None:
        """A free slot for ``owner`` (the one it holds already, if any); ``None`` when all are held."""
        if owner in self._held:
            return self._held[owner]
        if not self._free:
            return None
        slot = self._held[owner] = self._free.pop()
        return slot

    def sending(self, owner: str, rank: str) -> int:
        """``owner``'s slot for its send; a ``KVTransferError`` failing the send when every
        slot of ``rank`` is sending."""
        slot = self.take(owner)
        if slot is None:
            raise KVTransferError(owner, f"prefill rank {rank}: every state slot is sending")
        return slot

    def get(self, owner: str) -> int | None:
        return self._held.get(owner)

    def release(self, owner: str) -> None:
        slot = self._held.pop(owner, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def held(self) -> int:
        return len(self._held)

    def owners(self) -> set[str]:
        return set(self._held)
