"""Stop strings cut a choice's tokens with its text, so that every field the OpenAI edge
derives from the stream (text, ``token_ids``, logprobs, ``usage.completion_tokens``,
``best_of``'s cumulative logprob) covers the same tokens.

A chunk may hold many tokens (a speculative verify step, ``--stream-interval`` above 1, a
client that reads more slowly than its rank decodes), and a stop string may end in its middle.
Each token's own text comes from a detokenizer of the edge's own over the same ids, and the
same pair cache, as the request's stream (``detokenizer.py``): the texts of a chunk's tokens
join to the chunk's text.

The cut, where the earliest stop string found begins at character ``s`` of the output::

    text     In the beginning STOP God       (stop = "STOP", s = 17)
    tokens   |In| the| beginning| |STOP| God|
    kept     |In| the| beginning| |            each ends at or before s
    text     "In the beginning "               exactly the kept tokens' text

    tokens   |In| the| beginning| STOP| God|   " STOP" holds text before s and the stop's start
    kept     |In| the| beginning|              it is dropped, with its text before s (" ")
    text     "In the beginning"

Rule: the kept tokens are the longest run from the start whose text ends at or before ``s``,
ending at a token that completed text of its own; the returned text is exactly their text. So
``usage.completion_tokens`` is the number of logprobs entries, and those tokens' text is the
returned text, always. A token whose text straddles ``s`` (text before the stop and the stop's
start, common with BPE's leading-space tokens) is dropped whole: the returned text then ends
before that token's part before the stop, which is never more than one token's text. OpenAI
and vLLM instead return the text up to ``s`` and every token up to the one that completed the
stop, so their tokens spell out more than their text; here the two never disagree. The text
never holds a stop string.

Tokens that complete no text of their own (the first bytes of a multi-byte character, a
skipped special token) go with the next token that does: they are held while their text is,
and dropped with it at a cut, except where their text on its own (bytes that never complete a
character, decoded as U+FFFD, as at a stream's end) is text before the stop: then they are kept
with it, and the cut is OpenAI's.

In a stream, text that could begin a stop string is held back until the next piece tells (as
OpenAI's streams do), and so are the tokens it belongs to; what :meth:`StopCut.feed` releases
ends at a token boundary. Without stop strings nothing is held and nothing is re-detokenised.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.frontend.detokenizer import PairCache, StreamDetokenizer
from tandem.frontend.openai_tools import held_back
from tandem.wire.logprobs import TokenLogprobs


@dataclass(frozen=True, slots=True)
class Released:
    """Tokens a choice may send now, their logprobs (``None`` where none were computed) and
    their text."""

    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


_NOTHING = Released("", [], [])


class StopCut:
    """One choice's tokens in, in order; what is safe to send out, cut at the first stop string.

    ``stopped`` turns true once a stop string was found; everything fed after it is dropped."""

    def __init__(self, stops: Sequence[str], texts: PairCache) -> None:
        self.stops = tuple(stops)
        self.stopped = False
        self._cache = texts
        self._detokenizer = StreamDetokenizer(texts) if self.stops else None
        # held: tokens not sent yet, each with its logprobs and the text it completed
        self._ids: list[int] = []
        self._logprobs: list[TokenLogprobs | None] = []
        self._texts: list[str] = []

    def feed(
        self, token_ids: Sequence[int], text: str, logprobs: Sequence[TokenLogprobs | None] | None
    ) -> Released:
        """The next chunk: its tokens, their text (used as it is without stop strings; with them
        each token's text is its own detokenizer's) and their logprobs (``None``: none)."""
        entries: Sequence[TokenLogprobs | None] = logprobs if logprobs else [None] * len(token_ids)
        if len(entries) != len(token_ids):
            raise ValueError(f"logprobs: {len(entries)} entries for {len(token_ids)} tokens")
        if self.stopped:
            return _NOTHING
        if self._detokenizer is None:
            return Released(text, list(token_ids), list(entries))
        add = self._detokenizer.add
        for token in token_ids:
            self._texts.append(add(token))
        self._ids += token_ids
        self._logprobs += entries
        return self._release(final=False)

    def finish(self) -> Released:
        """The stream ended without a stop string so far: what is held, with the text its last
        tokens left incomplete (decoded as U+FFFD), cut if a stop string is in it."""
        if self.stopped or self._detokenizer is None:
            return _NOTHING
        tail = self._detokenizer.finish()
        if tail:  # the held tokens' incomplete character: the last token's text
            if not self._texts:  # cannot happen (the detokenizer holds only tokens fed here)
                return Released(tail, [], [])
            self._texts[-1] += tail
        return self._release(final=True)

    def _release(self, final: bool) -> Released:
        held = "".join(self._texts)
        found = [at for at in (held.find(s) for s in self.stops) if at >= 0]
        if found:
            self.stopped, bound = True, min(found)
        elif final:
            bound = len(held)
        else:  # text that may begin a stop string waits for the next chunk
            bound = len(held) - max(held_back(held, s) for s in self.stops)
        count = end = at = 0
        for i, text in enumerate(self._texts):
            at += len(text)
            if at > bound:
                run = self._run_text(count, i) if self.stopped else None
                if run is not None and held.startswith(run, end) and end + len(run) <= bound:
                    count, end = i, end + len(run)  # the run's own text is before the stop
                break
            if text:  # a token that completed text of its own: a boundary to cut at
                count, end = i + 1, at
        if final and not self.stopped:
            count, end = len(self._ids), len(held)
        released = Released(held[:end], self._ids[:count], self._logprobs[:count])
        if self.stopped:
            self._ids, self._logprobs, self._texts = [], [], []
        else:
            del self._ids[:count], self._logprobs[:count], self._texts[:count]
        return released

    def _run_text(self, start: int, stop: int) -> str | None:
        """The text of held tokens ``start .. stop - 1``, which completed none (token ``stop``
        brought theirs with its own), decoded on their own: bytes that never complete a
        character, as U+FFFD. ``None`` for no tokens."""
        if start == stop:
            return None
        assert self._detokenizer is not None
        ids, decode = self._detokenizer.ids, self._cache.decode
        first = len(ids) - len(self._ids) + start  # the run's place in the whole output
        context = max(first - 1, 0)  # the token before the run completed its text
        return decode(ids[context : first + stop - start])[len(decode(ids[context:first])) :]
