"""Incremental detokenisation for many streams at once, with the text of a token after its
predecessor remembered across streams.

:class:`StreamDetokenizer` follows ``model/tokenizer.py``'s :class:`IncrementalDetokenizer`
step for step (a token's text is ``decode(ids[prefix:])`` past ``decode(ids[prefix:read])``,
held back while it ends in an incomplete character), so both give the same text. In the steady
state, where every token so far completed its text, the window is just ``[previous, token]``:
the text added is then a pure function of that pair, which :class:`PairCache` keeps for every
stream of one tokenizer. A token then costs a dictionary lookup instead of two calls into the
tokenizer. Any other window (bytes held back for an incomplete character: every character of
more than one byte a byte-level tokenizer splits) is a pure function of its ids and where the
emitted part ends, and is kept too, up to ``MAX_WINDOW`` tokens: only a window seen for the first
time calls the tokenizer.

::

    ids:  [ ... previous | token ]      steady state: text = pairs[(previous, token)]
          [ ... prefix ... read | new ] otherwise: text = windows[(ids[prefix:], read - prefix)]
                                        = decode(prefix:) minus decode(prefix:read)
"""

from __future__ import annotations

from tandem.model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_FIRST = -1  # the "previous token" of a stream's first token
MAX_WINDOW = 8  # longer windows (a run of bytes that never completes a character) are not kept


class PairCache:
    """Text a token adds after a given previous token, and text a window of held-back tokens
    adds, for one tokenizer (shared by streams).

    Holds at most ``max_pairs`` pairs and as many windows; when full it starts again (the pairs a
    model's output uses come back within a few tokens)."""

    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = True, max_pairs: int = 1 << 18
    ) -> None:
        if max_pairs < 1:
            raise ValueError(f"max_pairs: must be at least 1, got {max_pairs}")
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.max_pairs = max_pairs
        # (previous, token) -> the text added, or None: the token leaves its text incomplete;
        # streams read it directly on every token (a hit needs no call), only :meth:`text` writes
        self.texts: dict[tuple[int, int], str | None] = {}
        # (window, tokens of it already emitted) -> the text its last tokens add, or None
        self.windows: dict[tuple[tuple[int, ...], int], str | None] = {}

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def text(self, previous: int, token: int) -> str | None:
        """The text ``token`` adds right after ``previous`` (``_FIRST``: at the start), both
        complete before it; ``None`` when ``token`` leaves an incomplete character."""
        key = (previous, token)
        try:
            return self.texts[key]
        except KeyError:
            pass
        prefix = self.decode([previous]) if previous != _FIRST else ""
        full = self.decode([previous, token]) if previous != _FIRST else self.decode([token])
        added = None if len(full) <= len(prefix) or full.endswith(_REPLACEMENT) else full[len(prefix) :]
        if len(self.texts) >= self.max_pairs:
            self.texts.clear()  # in place: streams hold the same dict
        self.texts[key] = added
        return added

    def window_text(self, window: list[int], emitted: int) -> str | None:
        """The text the tokens of ``window`` past its first ``emitted`` add to those before
        them; ``None`` while they leave an incomplete character."""
        key = (tuple(window), emitted)
        try:
            return self.windows[key]
        except KeyError:
            pass
        prefix_text = self.decode(window[:emitted])
        new_text = self.decode(window)
        added = (
            None
            if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT)
            else new_text[len(prefix_text) :]
        )
        if len(window) <= MAX_WINDOW:
            if len(self.windows) >= self.max_pairs:
                self.windows.clear()
            self.windows[key] = added
        return added


class StreamDetokenizer:
    """One stream's token ids in, text deltas out, never splitting a UTF-8 character."""

    def __init__(self, cache: PairCache) -> None:
        self._cache = cache
        self._texts = cache.texts
        self.ids: list[int] = []  # every token fed, in order (read, never changed, by the stream)
        self._prefix_offset = 0
        self._read_offset = 0

    def add(self, token_id: int) -> str:
        """Feed one token id; the text it completes (possibly empty)."""
        ids, prefix, read = self.ids, self._prefix_offset, self._read_offset
        ids.append(token_id)
        if read == len(ids) - 1 and read - 1 <= prefix:  # the window is [previous, token] or [token]
            previous = ids[prefix] if prefix < read else _FIRST
            try:
                text = self._texts[(previous, token_id)]  # the cache's lookup, inline
            except KeyError:
                text = self._cache.text(previous, token_id)
            if text is None:  # held back: the next tokens decode from the same window
                return ""
            self._prefix_offset, self._read_offset = read, read + 1
            return text
        text = self._cache.window_text(ids[prefix:], read - prefix)
        if text is None:
            return ""
        self._prefix_offset, self._read_offset = read, len(ids)
        return text

    def finish(self) -> str:
        """Text still held back at the end (an incomplete character decodes as U+FFFD)."""
        if self._read_offset == len(self.ids):  # nothing held back: no call to make
            return ""
        decode = self._cache.decode
        prefix_text = decode(self.ids[self._prefix_offset : self._read_offset])
        new_text = decode(self.ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self.ids)
        return new_text[len(prefix_text) :]
