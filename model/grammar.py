"""Structured outputs' token masks: :class:`GuidedRows` holds a matcher per guided request and
gives a step's masks (``model/grammar_compiler.py`` compiles the guides). A matcher's state
follows from its guide and the request's outputs so far, which every sampling chunk of such a
request carries (``ScheduledChunk.history``): before a row is masked its matcher takes the outputs
it has not seen yet. The rank that samples the first token (a prefill rank), the decode rank that
takes the request on and one it migrates to all rebuild the same state from the tokens, with
nothing shipped between them; a matcher dropped from the bounded table is rebuilt the same way.
Special tokens are never allowed, EOS only once the grammar is complete.
"""

from __future__ import annotations

import collections
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from tandem.model.grammar_compiler import GrammarCompiler as GrammarCompiler
from tandem.model.grammar_compiler import GrammarTimeLimit as GrammarTimeLimit
from tandem.model.grammar_compiler import _xgr
from tandem.model.grammar_compiler import encoded_vocab as encoded_vocab
from tandem.wire.request_params import Guide, InvalidRequestError

if TYPE_CHECKING:
    import xgrammar as xgr

log = logging.getLogger(__name__)

MATCHERS = 4096  # per rank: a dropped one is rebuilt from the request's tokens


@dataclass
class _Matcher:
    guide: Guide
    matcher: xgr.GrammarMatcher | None  # None: its guide did not compile (broken)
    fed: int = 0  # the outputs it has taken
    last: int | None = None  # the last of them
    broken: bool = False  # an output it could not take: only EOS is allowed from here


class GuidedRows:
    """Matchers of one rank's guided requests, and each step's token masks."""

    def __init__(self, compiler: GrammarCompiler, eos_token_id: int | None) -> None:
        self.compiler = compiler
        self.eos_token_id = eos_token_id
        self._matchers: collections.OrderedDict[str, _Matcher] = collections.OrderedDict()
        self.rebuilt = 0  # matchers made from a request's tokens so far (not its first)

    def allowed(self, rows: Sequence[tuple[str, Guide, Sequence[int]]]) -> torch.Tensor:
        """``[len(rows), vocab]`` bool, True where row ``(request id, guide, outputs so far)``
        may sample the token."""
        vocab, xgr = self.compiler.vocab_size, _xgr()
        bitmask = xgr.allocate_token_bitmask(len(rows), vocab)
        for i, (request_id, guide, outputs) in enumerate(rows):
            try:
                state = self._state(request_id, guide, outputs)
            except InvalidRequestError as exc:  # the edges compile first: a request sent around them
                log.error("request %s: its guide does not compile (%s); it ends here", request_id, exc)
                state = _Matcher(guide, None, broken=True)
                self._matchers[request_id] = state
            if state.broken:
                bitmask[i].zero_()
                if self.eos_token_id is not None:
                    bitmask[i, self.eos_token_id // 32] = 1 << (self.eos_token_id % 32)
            else:
                assert state.matcher is not None
                state.matcher.fill_next_token_bitmask(bitmask, i)
        bits = (bitmask[:, :, None] >> torch.arange(32, dtype=torch.int32)) & 1
        return bits.bool().reshape(len(rows), -1)[:, :vocab]

    def _state(self, request_id: str, guide: Guide, outputs: Sequence[int]) -> _Matcher:
        state = self._matchers.get(request_id)
        # the outputs only grow; a matcher that saw others (a request id used again) starts over
        if state is not None and state.matcher is None and state.guide == guide:
            return state  # its guide did not compile: it ends
        if state is None or state.guide != guide or not _continues(state, outputs):
            if state is not None or outputs:
                self.rebuilt += 1
            state = _Matcher(guide, _xgr().GrammarMatcher(self.compiler.compile(guide)))
            self._matchers[request_id] = state
        self._matchers.move_to_end(request_id)
        for token in outputs[state.fed :]:
            state.fed, state.last = state.fed + 1, token
            if state.matcher is not None and not state.broken and not state.matcher.accept_token(token):
                state.broken = True  # not one the mask allowed (a stop token the user gave...)
        while len(self._matchers) > MATCHERS:
            self._matchers.popitem(last=False)
        return state

    def mark_broken(self, request_id: str, guide: Guide) -> None:
        """The request's guide did not compile here (or not in time): its rows get only EOS,
        and no step waits for its compile."""
        self._matchers[request_id] = _Matcher(guide, None, broken=True)

    def forget(self, request_id: str) -> None:
        """Drop a request's matcher (it ended; one kept would be rebuilt if it came back)."""
        self._matchers.pop(request_id, None)

    def __len__(self) -> int:
        return len(self._matchers)


def _continues(state: _Matcher, outputs: Sequence[int]) -> bool:
    return len(outputs) >= state.fed and (state.fed == 0 or outputs[state.fed - 1] == state.last)
