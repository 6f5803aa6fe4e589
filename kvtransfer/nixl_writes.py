"""A send's WRITEs through a NIXL agent: posted from the two prepared descriptor lists by index,
their states read, their handles released. NIXL's own errors fail the one transfer they belong
to, never the caller's step. Called with the transport's lock held."""

from __future__ import annotations

import time
from typing import Any

from tandem.kvtransfer.nixl_records import Send
from tandem.kvtransfer.regions import TransferLayout
from tandem.kvtransfer.types import KVTransferError


class NixlWrites:
    def __init__(self, agent: Any, local_dlist: Any, layout: TransferLayout) -> None:
        self.agent, self._local, self._layout = agent, local_dlist, layout

    def post_ready(self, send: Send) -> None:
        """Post, in order, the waiting layers whose events have completed; the first one still
        running holds back the rest."""
        while send.waiting and send.error is None and send.waiting[0].complete():
            entry = send.waiting.pop(0)
            if entry.done_s is not None:
                send.device_done_s = max(send.device_done_s, entry.done_s)
            self.post(send, entry.layers)

    def post(self, send: Send, layers: list[int]) -> None:
        """Post the writes of ``layers``; one NIXL refuses sets the send's error (nothing of it is
        in flight), and the transport reports it once the writes already posted are drained."""
        src, dst, nbytes = self._layout.indices(send.runs, layers, send.peer.meta.layout)
        try:
            handle = self.agent.make_prepped_xfer("WRITE", self._local, src, send.peer.dlist, dst)
            if send.stats.start_s == 0.0:
                send.stats.start_s = time.monotonic()  # the first post
            refused = self.agent.transfer(handle) == "ERR"
        except Exception as exc:  # NIXL's own errors
            refused, handle = True, None
            detail = f"{type(exc).__name__}: {exc}"
        else:
            detail = "refused"
        if refused:
            if handle is not None:
                handle.release()
            send.error = KVTransferError(send.request_id, f"NIXL write to {send.peer.meta.rank}: {detail}")
            return
        send.posted.append(handle)
        send.stats.bytes += nbytes  # what the descriptor entries cover
        send.stats.layers_written += len(layers)

    def states(self, send: Send) -> list[str]:
        """Each posted write's state: PROC, DONE or ERR."""
        return [self._state(handle) for handle in send.posted]

    def _state(self, handle: Any) -> str:
        try:
            return str(self.agent.check_xfer_state(handle))
        except Exception:  # NIXL's own errors: this transfer failed, nothing else did
            return "ERR"

    def descriptors(self, send: Send) -> int:
        """How many descriptors the posted writes covered, by NIXL's telemetry."""
        return sum(self._descriptors(handle) for handle in send.posted)

    def _descriptors(self, handle: Any) -> int:
        try:
            return int(self.agent.get_xfer_telemetry(handle).descCount)
        except Exception:  # telemetry is a figure, never a reason to fail a transfer
            return 0

    @staticmethod
    def release(send: Send) -> None:
        for handle in send.posted:
            handle.release()
        send.posted = []
        send.waiting = []
