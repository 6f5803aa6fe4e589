"""Stand-ins the transfer tests share: a ready event the test completes by hand, as a GPU's CUDA
event completes when the device gets there, and wrappers of a real NIXL agent that record or hold
back what it does (everything they do not override is the real agent's)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from tandem.kvtransfer.types import decode_message


class HeldEvent:
    """A ready event that completes only when the test (or a thread standing in for the device)
    opens it: ``query`` does not block, ``synchronize`` blocks until then, as a CUDA event's."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self.opened_s = 0.0  # when it was opened, on the monotonic clock

    def open(self) -> None:
        self.opened_s = time.monotonic()
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()

    def synchronize(self) -> None:
        self._done.wait()


class CountingAgent:
    """A NIXL agent, recording each write it posts (when, and on which thread) and the kinds of
    the messages it receives."""

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.posted_s: list[float] = []
        self.posted_by: list[str] = []
        self.received: list[str] = []

    @property
    def posted(self) -> int:
        return len(self.posted_s)

    def transfer(self, handle: Any, *args: Any) -> Any:
        self.posted_s.append(time.monotonic())
        self.posted_by.append(threading.current_thread().name)
        return self._agent.transfer(handle, *args)

    def get_new_notifs(self) -> dict[str, list[bytes]]:
        notifs: dict[str, list[bytes]] = self._agent.get_new_notifs()
        for messages in notifs.values():
            self.received += [msg["kind"] for msg in map(decode_message, messages) if msg is not None]
        return notifs

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


class HeldWrites:
    """A NIXL agent reporting every write posted while ``holding`` as still in progress (``PROC``)
    until :meth:`release`: a write that is landing in the receiver's pages."""

    def __init__(self, agent: Any) -> None:
        self._agent, self.holding = agent, True
        self.held: set[int] = set()

    def transfer(self, handle: Any, *args: Any) -> Any:
        if self.holding:
            self.held.add(id(handle))
        return self._agent.transfer(handle, *args)

    def check_xfer_state(self, handle: Any) -> str:
        state = str(self._agent.check_xfer_state(handle))
        return "PROC" if id(handle) in self.held else state

    def release(self) -> None:
        self.holding = False
        self.held.clear()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)


def wait_until(
    condition: Callable[[], bool], timeout_s: float = 10.0, step: Callable[[], Any] | None = None
) -> None:
    """Until ``condition`` holds (``step`` called between looks), failing after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, f"not within {timeout_s}s"
        if step is not None:
            step()
        time.sleep(0.002)


def hold(seconds: float, invariant: Callable[[], bool], step: Callable[[], Any] | None = None) -> None:
    """For ``seconds``, check ``invariant`` again and again (``step`` called between looks)."""
    until = time.monotonic() + seconds
    while time.monotonic() < until:
        if step is not None:
            step()
        assert invariant()
        time.sleep(0.005)
