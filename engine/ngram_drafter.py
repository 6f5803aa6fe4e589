"""Prompt lookup: drafts from the request's own tokens, no weights.

The last ``n`` tokens (``n`` from ``ngram_max`` down to ``ngram_min``) are looked up in the
request's earlier tokens, prompt and outputs alike; at the latest earlier place they occur, the
tokens that followed are the drafts::

    tokens   ... the cat sat on the mat . the cat sat [?]
                     ^^^^^^^ ---------                        last 3 match at the latest place;
    drafts                   on the mat                       the 3 tokens after it

It pays where outputs copy their context (summaries, code edits, quoting, extraction) and costs
only the verify rows where they do not. The search runs over the tokens as 32-bit words in C
(``bytes.rfind``), an O(tokens) scan per request and step.
"""

from __future__ import annotations

from array import array
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from tandem.engine.drafter import Drafter

if TYPE_CHECKING:
    from tandem.engine.request import Request
    from tandem.engine.speculation import SpeculativeConfig


def lookup(tokens: Sequence[int], k: int, ngram_min: int, ngram_max: int) -> tuple[int, ...]:
    """Up to ``k`` tokens that followed the latest earlier occurrence of the longest suffix of
    ``tokens`` of ``ngram_max`` .. ``ngram_min`` tokens; ``()`` when none occurs."""
    if k <= 0 or len(tokens) < ngram_min + 1:
        return ()
    words = array("i", tokens).tobytes()
    size = len(tokens)
    for n in range(min(ngram_max, size - 1), ngram_min - 1, -1):
        pattern = words[(size - n) * 4 :]
        limit = (size - 1) * 4  # an occurrence must end before the last token: one follows it
        while True:
            at = words.rfind(pattern, 0, limit)
            if at < 0:
                break
            if at % 4 == 0:
                start = at // 4 + n
                return tuple(tokens[start : start + k])
            limit = at + len(pattern) - 1  # a misaligned hit: look before it
    return ()


class NgramDrafter(Drafter):
    def __init__(self, config: SpeculativeConfig, **_: Any) -> None:
        self.ngram_min, self.ngram_max = config.ngram_min, config.ngram_max

    def propose(self, requests: Sequence[Request], k: Mapping[str, int]) -> dict[str, tuple[int, ...]]:
        drafts = {}
        for request in requests:
            n = k.get(request.request_id, 0)
            draft = lookup(request.all_token_ids, n, self.ngram_min, self.ngram_max) if n else ()
            if draft:
                drafts[request.request_id] = draft
        return drafts
