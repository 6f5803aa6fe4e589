"""The drafter interface (the registry that builds one is ``engine/drafters.py``).

A drafter proposes, for each running request of a decode step, up to ``k`` tokens that it
expects the target to produce next. It never changes which tokens a request gets (the verify
step accepts a draft only when it equals the target's own sample: ``engine/speculation.py``);
a better drafter only makes more of them accepted. ``observe`` tells it what the verify step
accepted, for drafters that keep state between steps (the MTP layer's hidden state and KV).

Capabilities are class attributes: ``needs_weights`` (a drafter that runs a model layer of the
checkpoint) and ``needs_hidden`` (one that reads the target's last hidden states).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from tandem.engine.request import Request


class Drafter(ABC):
    needs_weights: ClassVar[bool] = False
    needs_hidden: ClassVar[bool] = False

    @abstractmethod
    def propose(self, requests: Sequence[Request], k: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        """At most ``k[request_id]`` draft tokens for each request (fewer, or none, when it has
        no guess); a request it leaves out decodes one token this step."""

    def start(self, request_id: str, hidden: Any = None) -> None:  # noqa: B027
        """``request_id``'s KV arrived: ``hidden`` is the target's last hidden state of the prefix
        the prefill rank computed (``needs_hidden`` drafters), or ``None`` when it sent none."""

    def observe(self, request_id: str, accepted: Sequence[int], hidden: Any = None) -> None:  # noqa: B027
        """The tokens the verify step gave ``request_id`` (its first is the target's own), with
        the target's hidden states at the positions that gave them (``needs_hidden`` drafters)."""

    def forget(self, request_id: str) -> None:  # noqa: B027
        """The request left this rank (finished, preempted or moved): drop what is kept for it."""
