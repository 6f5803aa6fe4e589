"""Every message a rank receives, as it arrives on the rank's one inbox (``RankLoop.post``).

Work reaches a rank from a frontend (over its channel: submits, aborts, subscriptions), from
another rank (a decode rank's prefill jobs, a prefill rank's answers to them) or from the
controller (the peers of the membership, their losses, a page-accounting check). Each is one of
these dataclasses; the loop takes them at the top of an iteration, in the order they came, and
dispatches them with one ``match`` (``engine/rank_loop.py``). Ray method calls remain for the
rank's control (setup, run, drain, stop, stats).

A message's payload is checked before it is posted, on the sender's thread (``Submit`` carries
what ``RankWorker.admit`` returned): a bad one fails alone, never the loop. The two questions
(``CheckIntegrity``, ``Subscribe``) carry a ``Reply`` that the loop fills and the asker waits on.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from tandem.wire.prefill_job import PrefillJobAnswer

T = TypeVar("T")


class Reply(Generic[T]):
    """One answer from the loop thread to the thread that asked."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._value: T | None = None
        self._error: BaseException | None = None

    def give(self, answer: Callable[[], T]) -> None:
        """Run ``answer`` (on the loop thread) and hand its result or its exception over."""
        try:
            self._value = answer()
        except Exception as exc:  # the asker's to raise, not the loop's
            self._error = exc
        self._done.set()

    def wait(self, timeout_s: float, rank: str) -> T:
        """The answer; ``TimeoutError`` when the loop does not give it within ``timeout_s``."""
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"rank {rank}: the step loop did not answer within {timeout_s} s")
        if self._error is not None:
            raise self._error
        return self._value  # type: ignore[return-value]


@dataclass(frozen=True)
class Submit:
    """Requests (decode, colocated) or prefill jobs (prefill), as ``admit`` checked them.
    ``answer``: where a prefill rank's answers to the jobs go (the decode rank that sent them)."""

    admitted: Any
    answer: Callable[[list[PrefillJobAnswer]], None] | None = None


@dataclass(frozen=True)
class Abort:
    request_ids: tuple[str, ...]


@dataclass(frozen=True)
class JobAnswers:
    """Prefill ranks' answers to this decode rank's jobs."""

    answers: tuple[PrefillJobAnswer, ...]


@dataclass(frozen=True)
class SetPeers:
    """The ranks this one sends work to (a decode rank's prefill ranks), with their handles."""

    peers: dict[Any, Any] = field(hash=False)


@dataclass(frozen=True)
class ConnectPeers:
    """Reach the transports of these ranks of the other role now (the membership changed)."""

    ranks: tuple[str, ...]


@dataclass(frozen=True)
class PeersLost:
    """These ranks' processes are gone: fail every transfer with them at once."""

    ranks: tuple[str, ...]


@dataclass(frozen=True)
class CheckIntegrity:
    """Check the rank's page accounting between two iterations; ``reply`` gets ``None`` or the
    ``PageAccountingError``."""

    reply: Reply[None] = field(hash=False, compare=False)


@dataclass(frozen=True)
class Subscribe:
    """Push this rank's KV events to ``subscriber`` from now on; ``reply`` gets the starting
    snapshot, made on the loop thread so that no event falls between it and the next batch."""

    subscriber: str
    reply: Reply[Any] = field(hash=False, compare=False)


RankMessage = Submit | Abort | JobAnswers | SetPeers | ConnectPeers | PeersLost | CheckIntegrity | Subscribe
