"""A decode rank's requests whose pages are reserved and whose KV is on its way (WAITING_FOR_KV).

Each reservation has a number (``attempt``, from 0), a size (``num_reserved_tokens``) and a
deadline; a notification counts only for the current attempt, and its fields must fit the
reservation (``check_arrival``). A request here holds its pages until its transfer is over: the
scheduler takes it out (``pop``) on the KV's arrival or on the transfer's failure, never on a
deadline or an abort alone, since a write may still be in flight. ``expired`` reports each
reservation past its deadline once. Pure bookkeeping, torch-free.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.decode.decode_request import DecodeRequest
from tandem.decode.types import DecodeSchedulerConfig, KVNotificationError, Reservation
from tandem.engine.request import RequestStatus
from tandem.wire.logprobs import TokenLogprobs


class KVWaits:
    def __init__(self, config: DecodeSchedulerConfig) -> None:
        self.config = config
        self._waiting: dict[str, DecodeRequest] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def records(self) -> list[DecodeRequest]:
        return list(self._waiting.values())

    def reserve(self, entry: DecodeRequest, page_ids: list[int], num_tokens: int, now: float) -> Reservation:
        """``entry`` waits for the KV of its first ``num_tokens`` tokens in ``page_ids``: its next
        attempt, due by ``now`` plus the KV wait timeout."""
        request = entry.request
        request.page_ids = page_ids
        request.status = RequestStatus.WAITING_FOR_KV
        entry.attempt += 1
        entry.num_reserved_tokens = num_tokens
        entry.deadline_s = now + self.config.kv_wait_timeout_s
        entry.expiry_reported = False
        self._waiting[request.request_id] = entry
        return Reservation(request.request_id, tuple(page_ids), num_tokens, entry.deadline_s, entry.attempt)

    def current(self, request_id: str, attempt: int | None) -> DecodeRequest | None:
        """The waiting request of this id whose current attempt is ``attempt`` (any, for
        ``None``); ``None`` for an unknown id, another phase or an earlier attempt."""
        entry = self._waiting.get(request_id)
        if entry is None or (attempt is not None and attempt != entry.attempt):
            return None
        return entry

    def pop(self, request_id: str) -> DecodeRequest:
        """Its transfer is over: it leaves the wait (the caller moves it on)."""
        return self._waiting.pop(request_id)

    def expired(self, now: float) -> list[str]:
        """Ids past their deadline, each reported once per reservation (aborted ones are already
        being cancelled). They stay here: the caller aborts the transfer and its end pops them."""
        ids = []
        for request_id, entry in self._waiting.items():
            if not entry.aborting and not entry.expiry_reported and now >= entry.deadline_s:
                entry.expiry_reported = True
                ids.append(request_id)
        return ids


def check_arrival(
    entry: DecodeRequest,
    first_token: int,
    cached_tokens: int,
    prompt_logprobs: Sequence[TokenLogprobs | None],
) -> None:
    """Raise ``KVNotificationError`` naming the field when a notification cannot belong to
    ``entry``'s reservation: a first token that is no token id, more cached tokens than it
    reserved, prompt logprobs of another length than its prompt."""
    request = entry.request
    rid = request.request_id
    if not isinstance(first_token, int) or isinstance(first_token, bool) or first_token < 0:
        raise KVNotificationError(rid, "first_token", f"must be a token id >= 0, got {first_token!r}")
    if not 0 <= cached_tokens <= entry.num_reserved_tokens:
        raise KVNotificationError(
            rid, "cached_tokens", f"{cached_tokens} is outside [0, {entry.num_reserved_tokens}]"
        )
    if prompt_logprobs and len(prompt_logprobs) != request.num_prompt_tokens:
        raise KVNotificationError(
            rid,
            "logprobs.prompt",
            f"has {len(prompt_logprobs)} entries for a {request.num_prompt_tokens}-token prompt",
        )
