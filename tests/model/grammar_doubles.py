"""A grammar compiler whose compiles can be held back, for tests of what waits on one."""

from __future__ import annotations

import json
import threading
from collections.abc import Collection
from typing import Any

from tandem.model.grammar_compiler import GrammarCompiler
from tandem.wire.request_params import Guide, GuideKind

# a string of up to 2,000 characters: about 1.2 s to compile on the demo's vocabulary (a real
# compile, for limits below that), in a schema short enough for a tool's prompt
SLOW_SCHEMA = {
    "type": "object",
    "properties": {"text": {"type": "string", "maxLength": 2000}},
    "required": ["text"],
}
SLOW_GUIDE = Guide(GuideKind.JSON_SCHEMA, json.dumps(SLOW_SCHEMA))


class HeldCompiler(GrammarCompiler):
    """xgrammar's compiles, those of ``held`` guides (all: ``None``) waiting for ``release``
    first, at most ``max_hold_s`` (code that waits on one is then seen waiting, not hung);
    with ``meet`` > 1, each compile waits until that many run at once (at most ``max_hold_s``)."""

    def __init__(
        self,
        *args: Any,
        held: Collection[Guide] | None = None,
        meet: int = 1,
        max_hold_s: float = 3.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.held, self.max_hold_s = held, max_hold_s
        self.release = threading.Event()
        self.together = threading.Barrier(meet, timeout=max_hold_s) if meet > 1 else None
        self._count = threading.Lock()
        self.running = 0
        self.most_at_once = 0

    def _build(self, compiler: Any, guide: Guide) -> Any:
        with self._count:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            if self.together is not None:
                self.together.wait()
            if self.held is None or guide in self.held:
                self.release.wait(self.max_hold_s)
            return super()._build(compiler, guide)
        finally:
            with self._count:
                self.running -= 1
