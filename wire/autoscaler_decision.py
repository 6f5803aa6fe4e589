"""One autoscaling decision, as the controller records it and ``tandem status`` shows it."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Decision:
    """One pool's decision at one tick: ``action`` is ``add``, ``drain`` or ``hold``; ``rule``
    names what fired; ``inputs`` are the signals and the policy's state it decided from."""

    pool: str
    action: str
    rule: str
    ready_groups: int
    desired_groups: int
    inputs: dict[str, Any] = field(default_factory=dict)
    pending_groups: int = 0  # groups of the pool still starting or draining when it was decided

    @property
    def reason(self) -> str:
        """The kind of the rule, for a metric label: plan, slo, queue, kv, demand, calm, budget,
        pending, settling, min_groups or max_groups."""
        words = self.rule.replace(",", " ").replace(":", " ").split()
        return words[1] if words[0] == "at" else words[0]

    @property
    def count(self) -> int:
        """Groups to add or drain: an add's desired size counts the groups still starting
        (``pending_groups``), which it does not start again."""
        if self.action == "add":
            return max(self.desired_groups - self.ready_groups - self.pending_groups, 1)
        return max(self.ready_groups - self.desired_groups, 1)

    def to_json(self) -> str:
        return json.dumps({"event": "autoscaler_decision", **asdict(self)}, sort_keys=True)
